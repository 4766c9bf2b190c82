"""SCons builders: render -> compile -> bundle, one .so per kernel key. SCons wiring only.

Build identity (what makes a kernel rebuild) is exactly, derived per key by tiledispatch.generator.deps:
  render:  the key (a Value node), the templates its family declares for it, the rules files, the Python
           modules the rendering runs (the import closure of the generator's codegen, the key's family module
           and its backend's module), and this action's code;
  compile: the rendered source, our headers it includes (the ABI header), the backend's toolchain module, the
           compile flags and the toolchain identity (compiler version, third-party header versions) through the
           action's varlist. The compiler launcher (launcher=ccache) is not part of it: it prefixes the compile
           command outside the varlist, so kernels built with and without one are the same cache entries.
Change any of them and exactly the affected kernels rebuild; change none and nothing does.

The CacheDir holds compiled kernels only (rendering is cheap, so sources are rendered, never fetched), each
with a record of its sha256 written before the entry is published; a fetched entry that does not match its
record, or has none, is removed, reported and rebuilt, so a truncated or altered cache file never reaches a
bundle. The record detects corruption and stray edits; whoever can write the cache can also rewrite records.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import SCons.Action
import SCons.CacheDir
import SCons.Errors
import SCons.Util
from SCons.Script import Action, Builder

from tiledispatch import abi, backends, bundle
from tiledispatch.generator import codegen, deps, toolchains
from tiledispatch.spec.key import KernelKey

RECORD_SUFFIX = ".sha256"   # a cache entry's record: the sha256 of its bytes when it was stored
RESERVED_NAMES = ("src", "lib", "check")  # build_dir's own subdirectories


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


def build_identity(node) -> str:
    """A built file's identity: the hash of its inputs' contents, its action (command, flags, toolchain identity)
    and its name, without paths: the CacheDir's key, and each kernel's build_id in the manifest (the sweep ties its
    times to it: nvcc's output differs in bytes from one cold build to the next, the inputs do not)."""
    sigs = [n.get_cachedir_csig() for n in node.children()]
    sigs += [node.get_contents_sig(), node.name]
    return SCons.Util.hash_collect(sigs)


class KernelCacheDir(SCons.CacheDir.CacheDir):
    """CacheDir keyed on the inputs, the action and the file name, not on the build directory, so a
    fresh build_dir (or a fresh checkout) fetches every unchanged kernel from a warm cache. Entries are
    verified against their records when fetched (see the module docstring)."""

    def cachepath(self, node):
        if not self.is_enabled():
            return None, None
        sig = build_identity(node)
        subdir = os.path.join(self.path, sig[:self.config["prefix_len"]].upper())
        return subdir, os.path.join(subdir, sig)

    def retrieve(self, node):
        if not self.is_enabled():
            return False
        if SCons.CacheDir.CacheRetrieveSilent(node, [], node.get_build_env(), execute=1) != 0:
            return False
        name, suffix = os.path.splitext(node.name)
        if SCons.Action.execute_actions:  # (nothing was copied under -n)
            _, cachefile = self.cachepath(node)
            problem = _entry_problem(cachefile, node.get_abspath())
            if problem:
                for path in (node.get_abspath(), cachefile, cachefile + RECORD_SUFFIX):
                    _unlink(path)
                print(f"tiledispatch: cache entry of {name} {problem}: removed it; rebuilding", flush=True)
                return False
        if suffix in (".so", ".check"):  # a compiled kernel or a check stamp: our own line instead of SCons's
            PROGRESS.record("cached", name)
        return True

    def push(self, node):
        if self.is_readonly() or not self.is_enabled() or node.nocache:
            return
        cachedir, cachefile = self.cachepath(node)
        if os.path.isfile(cachefile) and os.path.isfile(cachefile + RECORD_SUFFIX):
            return  # stored meanwhile by a concurrent build
        try:
            os.makedirs(cachedir, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cachedir) as tmp:
                entry, record = os.path.join(tmp, "entry"), os.path.join(tmp, "record")
                shutil.copy2(node.get_abspath(), entry)
                with open(record, "w") as f:
                    f.write(bundle.sha256_file(entry) + "\n")
                os.replace(record, cachefile + RECORD_SUFFIX)  # the record first: no entry is visible without one
                os.replace(entry, cachefile)
        except OSError as e:  # the build is complete without the cache; say so and go on
            print(f"tiledispatch: warning: {os.path.splitext(node.name)[0]} was not stored in the cache: {e}",
                  flush=True)


def _entry_problem(cachefile: str, fetched: str) -> str | None:
    """Why the fetched copy of a cache entry cannot be trusted, or None when it matches its record."""
    if os.path.islink(cachefile):
        return "is a symbolic link"
    record = _read_record(cachefile + RECORD_SUFFIX)
    if record is None:
        return "has no recorded sha256"
    if bundle.sha256_file(fetched) != record:
        return "does not match the sha256 recorded when it was stored"
    return None


def _read_record(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        text = f.read(80).decode("ascii", "replace").strip()
    return text if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else None


def use_cache_dir(env, path: str) -> str | None:
    """Point env at the kernel cache in path, creating it and its parents; why it cannot be used, or None."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # SCons creates only the last level
        env.CacheDir(path, custom_class=KernelCacheDir)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe")  # writable? (root passes any permission check)
        os.close(fd)
        os.unlink(probe)
    except (OSError, SCons.Errors.SConsEnvironmentError, SCons.Util.SConsLockFailure) as e:
        cause = e if isinstance(e, OSError) else (e.__cause__ or e)
        if isinstance(cause, OSError) and cause.strerror:
            reason = cause.strerror + (f" ({cause.filename})" if cause.filename else "")
        else:
            reason = str(cause)
        return (f"cache_dir {path} cannot be used: {reason}; give a writable directory, or cache_dir=none "
                "to build without a cache")
    return None


def bundle_name_problem(name: str) -> str | None:
    """Why name cannot be a bundle's directory under build_dir, or None: it must be a plain name."""
    if not name:
        return "is empty"
    if name in (".", "..") or "/" in name or (os.altsep and os.altsep in name) or "\0" in name:
        return "must be a plain name under build_dir, not a path"
    if name in RESERVED_NAMES:
        return f"is reserved for build_dir/{name}"
    return None


def _render_action(target, source, env):
    key = KernelKey.from_json(source[0].read())
    text = codegen.render(key, Path(env["TD_TEMPLATES_ROOT"]))
    _write_atomic(str(target[0]), text)
    return 0


def _compile_action(target, source, env):
    key = KernelKey.from_json(env["TD_KEY"])
    backend = toolchains.check(key.backend) if env["TD_MODE"] == "check" else toolchains.get(key.backend)
    out = str(target[0])
    tmp = f"{out}.tmp{os.getpid()}{threading.get_ident()}"
    launcher = list(env.get("TD_LAUNCHER") or [])  # not in the action's varlist: never part of the identity
    if env["TD_MODE"] == "check":
        steps, intermediates = [(launcher + backend.check_command(key, backend.check_toolchain(), str(source[0]),
                                                                  tmp), None)], []
    else:
        steps, intermediates = compile_steps(
            backend, key, backend.toolchain(), str(source[0]), tmp, launcher,
            [str(d) for d in codegen.include_dirs(key, Path(env["TD_TEMPLATES_ROOT"]))])
    start = time.time()
    for cmd, cwd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
        if proc.returncode != 0:
            shown = (f"(in {cwd}) " if cwd else "") + " ".join(cmd)
            PROGRESS.record("FAILED", key.name, f"\n  declared in {env['TD_ORIGIN']}\n  command: {shown}\n"
                            + _tail(proc.stdout + proc.stderr))
            break
    for path in intermediates:
        _unlink(path)
    if proc.returncode != 0:
        _unlink(tmp)
        return 1
    os.replace(tmp, out)  # publish whole files only
    PROGRESS.record("checked" if env["TD_MODE"] == "check" else "compiled", key.name, f" ({time.time() - start:.1f} s)")
    return 0


def compile_steps(backend, key, tc, source: str, output: str, launcher: list[str], include_dirs: list[str]):
    """([(command, working directory or None for this process's)], [intermediate files to remove]): the
    commands that make the kernel library from its rendered source. The launcher (ccache, sccache, distcc;
    may be empty) prefixes the compile.

    A toolchain with object_command and link_command compiles an object in the source's directory with
    relative file names, then links it without the launcher: compiler caches cache compiles, never links, and
    a compile command that names no build directory hits their cache from any build directory."""
    if toolchains.missing(backend, toolchains.LINK_API):
        return [(launcher + backend.compile_command(key, tc, source, output, include_dirs), None)], []
    src_dir = os.path.dirname(os.path.abspath(source))
    obj = f"{os.path.basename(output)}.o"  # next to the source: a relative name; unique per worker like output
    obj_path = os.path.join(src_dir, obj)
    return [(launcher + backend.object_command(key, tc, os.path.basename(source), obj, include_dirs),
             src_dir),
            (backend.link_command(key, tc, obj_path, output), None)], [obj_path]


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
    # each installed kernel file's source is its compiled library: that build's identity
    build_ids = {Path(str(node)).stem: build_identity(node.sources[0]) for node in source if node.sources}
    bundle.write_manifest(bundle_dir, keys, backend=env["TD_BACKEND"], arch=env["TD_ARCH"],
                          toolchain=dict(env["TD_TOOLCHAIN_INFO"]), kernel_sets=list(env["TD_SETS"]),
                          origins=dict(env["TD_ORIGINS"]), build_ids=build_ids)
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


def add_kernels(env, entries, *, backend_name: str, mode: str, build_dir: str, templates_root: str):
    """Render and compile every entry; returns {key name: .so (or check output) node}."""
    backend = toolchains.check(backend_name) if mode == "check" else toolchains.get(backend_name)
    tc = backend.check_toolchain() if mode == "check" else backend.toolchain()
    if mode == "check":  # the whole check command is its identity, less the paths of this checkout
        def flags_of(key, tc):  # (the ABI header's content is a dependency of its own)
            cmd = backend.check_command(key, tc, "<source>", "<output>")
            return [arg.replace(str(abi.INCLUDE_DIR), "<abi>") for arg in cmd]
    else:
        flags_of = backend.compile_flags
    out = {}
    PROGRESS.total = len(entries)
    for entry in entries:
        key = entry.key
        src = env.TdRender(f"{build_dir}/src/{codegen.source_name(key)}", env.Value(key.to_json()),
                           TD_TEMPLATES_ROOT=templates_root)
        env.NoCache(src)  # rendered, never fetched: only compiled kernels are cached (and verified)
        env.Depends(src, [str(p) for p in deps.render_inputs(key, Path(templates_root))])
        suffix = ".check" if mode == "check" else ".so"
        lib = env.TdCompile(f"{build_dir}/{'check' if mode == 'check' else 'lib'}/{key.name}{suffix}", src,
                            TD_KEY=key.to_json(), TD_ORIGIN=entry.origin, TD_MODE=mode, TD_TEMPLATES_ROOT=templates_root,
                            TD_FLAGS=" ".join(flags_of(key, tc)), TD_TOOLCHAIN=tc.identity)
        env.Depends(lib, [str(p) for p in deps.compile_inputs(key, Path(templates_root))])
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
    env.Precious(manifest)  # the old manifest names the kernel files a rebuild may delete (written atomically)
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
