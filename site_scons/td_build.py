"""SCons builders: render -> compile -> bundle, one .so per kernel key. SCons wiring only.

Build identity (what makes a kernel rebuild) is exactly:
  render:  the key (a Value node), the templates the key uses, the generator modules (spec/,
           codegen/, the backend's module), and this action's code;
  compile: the rendered source, the ABI header, the compile flags and the toolchain identity
           (compiler version, third-party header versions) through the action's varlist.
Change any of them and exactly the affected kernels rebuild; change none and nothing does.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import SCons.CacheDir
import SCons.Util
from SCons.Script import Action, Builder

from tiledispatch import abi, backends, bundle
from tiledispatch import codegen
from tiledispatch.spec.key import KernelKey

RUNTIME_PKG = Path(abi.__file__).resolve().parent
GENERATOR_DIRS = ("spec", "codegen")


class Progress:
    """[i/N] lines and the final counts; shared by the worker threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.total = 0
        self.done = 0
        self.compiled = 0
        self.cached = 0
        self.failed: list[str] = []

    def record(self, outcome: str, name: str, extra: str = "") -> None:
        """Count one kernel as compiled / checked / cached / failed and print its [i/N] line."""
        with self.lock:
            self.done += 1
            if outcome == "FAILED":
                self.failed.append(name)
            elif outcome == "cached":
                self.cached += 1
            else:
                self.compiled += 1
            print(f"[{self.done}/{self.total}] {outcome:8s} {name}{extra}", flush=True)


PROGRESS = Progress()


class KernelCacheDir(SCons.CacheDir.CacheDir):
    """CacheDir keyed on the inputs, the action and the file name, not on the build directory, so a
    fresh build_dir (or a fresh checkout) fetches every unchanged kernel from a warm cache."""

    def cachepath(self, node):
        if not self.is_enabled():
            return None, None
        sigs = [n.get_cachedir_csig() for n in node.children()]
        sigs += [node.get_contents_sig(), node.name]
        sig = SCons.Util.hash_collect(sigs)
        subdir = os.path.join(self.path, sig[:self.config["prefix_len"]].upper())
        return subdir, os.path.join(subdir, sig)

    def retrieve(self, node):
        if not self.is_enabled():
            return False
        if SCons.CacheDir.CacheRetrieveSilent(node, [], node.get_build_env(), execute=1) != 0:
            return False
        name, suffix = os.path.splitext(node.name)
        if suffix in (".so", ".check"):  # a compiled kernel or a check stamp: our own line instead of SCons's
            PROGRESS.record("cached", name)
        return True


def _render_action(target, source, env):
    key = KernelKey.from_json(source[0].read())
    text = codegen.render(key, Path(env["TD_TEMPLATES_ROOT"]))
    _write_atomic(str(target[0]), text)
    return 0


def _compile_action(target, source, env):
    key = KernelKey.from_json(env["TD_KEY"])
    backend = backends.get(key.backend)
    out = str(target[0])
    tmp = f"{out}.tmp{os.getpid()}{threading.get_ident()}"
    if env["TD_MODE"] == "check":
        tc = backend.check_toolchain()
        cmd = backend.check_command(key, tc, str(source[0]), tmp)
    else:
        tc = backend.toolchain()
        cmd = backend.compile_command(key, tc, str(source[0]), tmp, [str(abi.INCLUDE_DIR)])
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        PROGRESS.record("FAILED", key.name, f"\n  declared in {env['TD_ORIGIN']}\n  command: {' '.join(cmd)}\n"
                      + _tail(proc.stdout + proc.stderr))
        _unlink(tmp)
        return 1
    os.replace(tmp, out)  # publish whole files only
    PROGRESS.record("checked" if env["TD_MODE"] == "check" else "compiled", key.name, f" ({time.time() - start:.1f} s)")
    return 0


def _install_action(target, source, env):
    tmp = f"{target[0]}.tmp{os.getpid()}{threading.get_ident()}"
    shutil.copyfile(str(source[0]), tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, str(target[0]))
    return 0


def _bundle_action(target, source, env):
    keys = [KernelKey.from_json(k) for k in env["TD_BUNDLE_KEYS"]]
    bundle_dir = Path(str(target[0])).parent
    removed = bundle.remove_stale_kernels(bundle_dir, keys)
    if removed:
        print(f"tiledispatch: removed {len(removed)} kernel file(s) no longer in the bundle")
    bundle.write_manifest(bundle_dir, keys, backend=env["TD_BACKEND"], arch=env["TD_ARCH"],
                          toolchain=dict(env["TD_TOOLCHAIN_INFO"]), kernel_sets=list(env["TD_SETS"]),
                          origins=dict(env["TD_ORIGINS"]))
    return 0


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join("    " + ln for ln in text.strip().splitlines()[-lines:])


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}{threading.get_ident()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def generator_files(backend_name: str) -> list[str]:
    """Python modules and rule files whose change can change a rendered source."""
    files = []
    for d in GENERATOR_DIRS:
        files += sorted(str(p) for p in (RUNTIME_PKG / d).rglob("*") if p.suffix in (".py", ".yaml"))
    files += [str(RUNTIME_PKG / "backends" / "__init__.py"), str(RUNTIME_PKG / "backends" / f"{backend_name}.py")]
    return files


def add_kernels(env, entries, *, backend_name: str, mode: str, build_dir: str, templates_root: str):
    """Render and compile every entry; returns {key name: .so (or check output) node}."""
    backend = backends.get(backend_name)
    tc = backend.check_toolchain() if mode == "check" else backend.toolchain()
    if mode == "check":  # the whole check command is its identity, less the paths of this checkout
        def flags_of(key, tc):  # (the ABI header's content is a dependency of its own)
            cmd = backend.check_command(key, tc, "<source>", "<output>")
            return [arg.replace(str(abi.INCLUDE_DIR), "<abi>") for arg in cmd]
    else:
        flags_of = backend.compile_flags
    gen_files = generator_files(backend_name)
    out = {}
    PROGRESS.total = len(entries)
    for entry in entries:
        key = entry.key
        src = env.TdRender(f"{build_dir}/src/{codegen.source_name(key)}", env.Value(key.to_json()),
                           TD_TEMPLATES_ROOT=templates_root)
        env.Depends(src, [str(p) for p in codegen.template_files(key, Path(templates_root))] + gen_files)
        suffix = ".check" if mode == "check" else ".so"
        lib = env.TdCompile(f"{build_dir}/{'check' if mode == 'check' else 'lib'}/{key.name}{suffix}", src,
                            TD_KEY=key.to_json(), TD_ORIGIN=entry.origin, TD_MODE=mode,
                            TD_FLAGS=" ".join(flags_of(key, tc)), TD_TOOLCHAIN=tc.identity)
        env.Depends(lib, str(abi.INCLUDE_DIR / "tiledispatch_abi.h"))
        out[key.name] = lib[0]
    return out


def add_bundle(env, entries, libs, *, bundle_dir: str, backend_name: str, arch: str, sets, toolchain_identity):
    installed = []
    for entry in entries:
        installed += env.TdInstall(f"{bundle_dir}/{bundle.kernel_file(entry.key)}", libs[entry.key.name])
    manifest = env.TdBundle(f"{bundle_dir}/{bundle.MANIFEST}", installed,
                            TD_BUNDLE_KEYS=[e.key.to_json() for e in entries], TD_BACKEND=backend_name,
                            TD_ARCH=arch, TD_SETS=list(sets), TD_ORIGINS={e.key.name: e.origin for e in entries},
                            TD_TOOLCHAIN_INFO={"backend": backend_name, "identity": toolchain_identity,
                                               "python": sys.version.split()[0]})
    env.NoCache(installed + manifest)
    return manifest


def generate(env):
    env.Append(BUILDERS={
        "TdRender": Builder(action=Action(_render_action, strfunction=lambda *a, **k: None)),
        "TdCompile": Builder(action=Action(_compile_action, strfunction=lambda *a, **k: None,
                                           varlist=["TD_FLAGS", "TD_TOOLCHAIN", "TD_MODE"])),
        "TdInstall": Builder(action=Action(_install_action, strfunction=lambda *a, **k: None)),
        "TdBundle": Builder(action=Action(_bundle_action, "tiledispatch: writing $TARGET",
                                          varlist=["TD_BUNDLE_KEYS", "TD_BACKEND", "TD_ARCH"])),
    })
    env.AddMethod(add_kernels, "TdKernels")
    env.AddMethod(add_bundle, "TdBundleOf")


def exists(env):
    return True
