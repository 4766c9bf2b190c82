"""Build from Python: tiledispatch.build(...) -> Registry, through the command line's own build.

build() runs `scons` on the checkout's SConstruct in a subprocess, with the options a user would type, so a
kernel has one build path: the same builders, the same derived build identity and the same CacheDir, and a
kernel built from Python is a cache hit for the command line and the other way round. What the command line
cannot take as an argument (an in-memory declaration, explicit KernelKeys) is written as a kernel set file in
the set schema (kernelset.py) into the bundle's directory and named by its path. The subprocess (spawned, never
a fork that runs Python) also makes build() safe from a process that has initialised CUDA, and caps the compile
jobs by cores and free memory exactly as the command line does, because it is the command line.

The sets are expanded here first, with the same code: an illegal declaration is a SpecError naming the rule
before anything starts.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

import yaml

from .. import backends, registry
from ..errors import BuildError, InvalidInputError, SpecError
from ..spec.key import KernelKey
from . import kernelset, toolchains

log = logging.getLogger("tiledispatch.build")

SCONSTRUCT = kernelset.REPO_ROOT / "SConstruct"
DEFAULT_BUILD_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tiledispatch" / "bundles"
LOCK_FILE = ".tiledispatch-build.lock"
_PROGRESS_LINE = re.compile(r"^\[(\d+)/(\d+)\] (\S+)\s+(\S+)")

Declaration = Union[str, os.PathLike, dict, KernelKey]
Progress = Callable[[int, int, str, str], None]  # (done, total, outcome, kernel name); outcome: compiled,
                                                 # cached or FAILED


def build(sets_or_keys: Union[Declaration, Iterable[Declaration]], backend: str = "auto", arch: str = "auto",
          jobs: Optional[int] = None, build_dir: Union[str, os.PathLike, None] = None,
          cache_dir: Union[str, os.PathLike, None] = None, launcher: Union[str, list, None] = None,
          progress: Optional[Progress] = None, *, bundle: Optional[str] = None,
          max_kernels: int = kernelset.MAX_KERNELS) -> registry.Registry:
    """Build the kernels and load them as a Registry.

    sets_or_keys: one or a list of: a kernel set name (preselected/, kernel_specs/), a set file (.yaml), a set
    declared in memory (a dict in the set schema, with its name), or a KernelKey.
    backend, arch: as `scons backend= arch=` ("auto": detected here, as the command line does; with KernelKeys,
    theirs). jobs: compile jobs (default: the command line's, the CPU count capped by free memory).
    build_dir: where sources, libraries and the bundle go (default ~/.cache/tiledispatch/bundles).
    cache_dir: the CacheDir (default: the command line's, ~/.cache/tiledispatch/scons; "none" disables).
    launcher: compiler launcher such as "ccache" (never part of the build identity).
    progress: called with (done, total, outcome, name) per kernel compiled or fetched from the cache; default:
    the logger "tiledispatch.build" at INFO. bundle: the bundle's name (default: the set names joined by '+').

    Raises SpecError for a bad or illegal declaration (naming the rule), BuildError when a kernel does not
    compile (naming it, with its compiler output) or the build cannot start."""
    if jobs is not None and (not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1):
        raise InvalidInputError(f"jobs must be a positive integer, got {jobs!r}")
    items = _as_items(sets_or_keys)
    keys = [item for item in items if isinstance(item, KernelKey)]
    backend, arch = _target(backend, arch, keys)
    build_dir = Path(build_dir or DEFAULT_BUILD_DIR).resolve()
    declared = _declarations(items, keys)
    bundle = bundle or "+".join(stem for stem, _, _ in declared)
    if not isinstance(bundle, str) or bundle in ("", ".", "..") or Path(bundle).name != bundle:
        raise InvalidInputError(f"bundle={bundle!r}: the bundle name must be a plain name under build_dir, not a path")
    bundle_dir = build_dir / bundle
    if not SCONSTRUCT.is_file():
        raise BuildError(f"tiledispatch.build runs the SCons build of a source checkout; there is no {SCONSTRUCT} "
                         "(install from a checkout: pip install -e '.[build]')")
    if importlib.util.find_spec("SCons") is None:
        raise BuildError("tiledispatch.build needs SCons (pip install 'tiledispatch[build]')")
    build_dir.mkdir(parents=True, exist_ok=True)
    with _locked(build_dir):
        specs = []
        for stem, spec, content in declared:
            specs.append(spec if content is None else str(_write_declaration(bundle_dir, stem, content)))
        entries = kernelset.load(specs, backend, arch, max_kernels=max_kernels)  # SpecError: the rule named
        _check_keys_declared(keys, entries)
        args = [f"kernels={','.join(specs)}", f"backend={backend}", f"arch={arch}", f"build_dir={build_dir}",
                f"bundle={bundle}", f"max_kernels={max_kernels}"]
        if cache_dir is not None:
            args.append(f"cache_dir={cache_dir if str(cache_dir) == 'none' else Path(cache_dir).resolve()}")
        if launcher:
            words = shlex.split(launcher) if isinstance(launcher, str) else [os.fspath(w) for w in launcher]
            if words and os.sep in words[0]:
                words[0] = os.path.abspath(words[0])  # scons runs in the checkout, not here
            args.append(f"launcher={shlex.join(words)}")
        if jobs is not None:
            args.append(f"-j{jobs}")
        _run_scons(args, progress)
    return registry.load(bundle_dir)


def _as_items(sets_or_keys) -> list:
    if isinstance(sets_or_keys, (str, os.PathLike, dict, KernelKey)):
        sets_or_keys = [sets_or_keys]
    try:
        items = list(sets_or_keys)
    except TypeError:
        raise SpecError(f"build() takes kernel set names, set files, set declarations (dicts) or KernelKeys, got "
                        f"{type(sets_or_keys).__name__}") from None
    if not items:
        raise SpecError("build() was given no kernel sets or keys")
    for item in items:
        if not isinstance(item, (str, os.PathLike, dict, KernelKey)):
            raise SpecError(f"build() takes kernel set names, set files, set declarations (dicts) or KernelKeys, "
                            f"got {type(item).__name__}: {item!r:.80}")
    return items


def _target(backend: str, arch: str, keys: list[KernelKey]) -> tuple[str, str]:
    """The backend and arch to build for: given, else the keys', else detected as the command line does."""
    targets = {(k.backend, k.arch) for k in keys}
    if len(targets) > 1:
        listed = ", ".join(sorted(map("/".join, targets)))
        raise SpecError(f"the KernelKeys given are for several backends / archs ({listed}); build each in its own "
                        "call")
    if targets:
        (key_backend, key_arch), = targets
        for what, given, theirs in (("backend", backend, key_backend), ("arch", arch, key_arch)):
            if given != "auto" and given != theirs:
                raise SpecError(f"{what}={given}, but the KernelKeys given are for {theirs}")
        return key_backend, key_arch
    if backend == "auto":
        try:
            backend, reasons = toolchains.auto_select()
        except RuntimeError as e:
            raise BuildError(str(e)) from None
        log.info("backend=auto chose %s%s", backend, f" ({'; '.join(reasons)})" if reasons else "")
    elif backend not in backends.names():
        raise SpecError(f"unknown backend {backend!r} (known: {', '.join(backends.names())})")
    if arch == "auto":
        arch = backends.get(backend).detect_arch()
        if arch is None:
            raise BuildError(f"arch=auto found no {backend} device here; give arch=...")
        log.info("arch=auto chose %s", arch)
    return backend, arch


def _declarations(items: list, keys: list[KernelKey]) -> list[tuple[str, Optional[str], Optional[dict]]]:
    """(name, spec, content) per kernel set: the spec (a set name or a file's absolute path) of a set the user
    names, or the content of one to write (an in-memory declaration, or one set holding the KernelKeys)."""
    out = []
    for item in items:
        if isinstance(item, dict):
            name = item.get("name")
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
                raise SpecError(f"a kernel set declared in memory needs a name: a plain name (letters, digits, '_', "
                                f"'-', '.'), got {name!r}")
            out.append((name, None, item))
        elif not isinstance(item, KernelKey):
            spec = os.fspath(item)
            if spec.endswith((".yaml", ".yml")):
                spec = os.path.abspath(spec)  # scons runs in the checkout, not here
            if "," in spec:
                raise SpecError(f"kernel set {spec!r}: a name or path with ',' cannot be passed to the build")
            out.append((Path(spec).stem, spec, None))
    if keys:
        digest = hashlib.sha256("\n".join(sorted(k.to_json() for k in keys)).encode()).hexdigest()[:12]
        name = f"keys_{digest}"
        out.append((name, None, {"schema": kernelset.SET_SCHEMA_VERSION, "name": name,
                           "description": f"{len(keys)} kernel key(s) given to tiledispatch.build",
                           "groups": [_group_of(k) for k in dict.fromkeys(keys)]}))
    return out


def _group_of(key: KernelKey) -> dict:
    """A set-file group that declares exactly this key."""
    sig, alg = key.signature, key.algorithm
    group = {"backend": key.backend, "arch": key.arch, "op": sig.op,
             "dtypes": {"a": sig.dtype_a, "b": sig.dtype_b, "c": sig.dtype_c, "acc": sig.dtype_acc},
             "layout": sig.layout,
             "epilogue": {"activation": sig.epilogue.activation, "bias": sig.epilogue.bias,
                          "residuals": sig.epilogue.residuals},
             "tile": list(alg.tile), "warps": list(alg.warps), "mma": list(alg.mma), "cluster": list(alg.cluster),
             "pipeline": alg.pipeline, "scheduler": alg.scheduler, "split_k": alg.split_k, "stages": alg.stages}
    if sig.op == "conv":
        group.update(direction=sig.direction, spatial_dims=sig.spatial_dims)
    if alg.extras:
        group["extras"] = {name.split(".", 1)[1]: value for name, value in alg.extras}
    return group


def _write_declaration(bundle_dir: Path, name: str, content: dict) -> Path:
    """The set file of an in-memory declaration, in the bundle's directory (so the bundle says what it was built
    from, and `scons kernels=<that file>` rebuilds it); rewritten only when it changes."""
    bundle_dir.mkdir(parents=True, exist_ok=True)
    path = bundle_dir / f"{name}.yaml"
    try:
        text = yaml.safe_dump(content, sort_keys=False)
    except yaml.YAMLError as e:
        raise SpecError(f"kernel set {name} declared in memory cannot be written as YAML: {e}") from None
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


def _check_keys_declared(keys: list[KernelKey], entries) -> None:
    built = {e.key for e in entries}
    for key in keys:
        if key not in built:  # the set schema could not express it: a bug here, never a silently other kernel
            raise SpecError(f"kernel key {key.name} did not survive its declaration as a kernel set")


@contextlib.contextmanager
def _locked(build_dir: Path):
    """One build at a time per build directory (concurrent processes, JIT builds from several threads)."""
    with open(build_dir / LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run_scons(args: list[str], progress: Optional[Progress]) -> None:
    cmd = [sys.executable, "-m", "SCons", "-Q", "-C", str(SCONSTRUCT.parent), *args]
    log.debug("running %s", shlex.join(cmd))
    failures: dict[str, list[str]] = {}
    errors, tail = [], []
    failing = None  # the kernel whose report (indented lines after its FAILED line) is being read
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                          stdin=subprocess.DEVNULL) as proc:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail = (tail + [line])[-40:]
            if failing is not None and line.startswith("  "):
                failures[failing].append(line)
                continue
            failing = None
            m = _PROGRESS_LINE.match(line)
            if m:
                done, total, outcome, name = int(m[1]), int(m[2]), m[3], m[4]
                if outcome == "FAILED":
                    failing = name
                    failures[name] = []
                if progress is not None:
                    progress(done, total, outcome, name)
                else:
                    log.info("%s", line)
            elif line.startswith("tiledispatch: error: "):
                errors.append(line[len("tiledispatch: error: "):])
            elif line.startswith("tiledispatch: warning"):
                log.warning("%s", line)
            elif line.startswith("tiledispatch: "):  # what it builds with how many jobs, the summary
                log.info("%s", line[len("tiledispatch: "):])
            else:
                log.debug("%s", line)
    if proc.returncode == 0:
        return
    if failures:
        report = "\n".join(f"{name}:\n" + "\n".join(lines) for name, lines in failures.items())
        raise BuildError(f"{len(failures)} kernel(s) failed to compile: {', '.join(failures)}\n{report}",
                         {name: "\n".join(lines) for name, lines in failures.items()})
    raise BuildError("the build failed: " + ("; ".join(errors) if errors else "\n".join(tail)))
