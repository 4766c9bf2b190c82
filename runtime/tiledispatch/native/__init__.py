"""Native helpers of the runtime, compiled on first use for the torch they run with.

torch_fastpath.cpp does the torch fast paths' per-call work on the at::Tensor behind each Python tensor: the
fingerprints of a call's tensors (plan.prints3, Plan and tiledispatch.torch's call keys) and the eager operators'
remembered calls (their mode checks, output allocation and launch), 2-5 us less host time per cached call
(bench/results/native_fastpath_* and native_launch_*), and records the torch operators' differentiable calls in the
autograd graph by a C++ node around their Python forward and backward functions (record), cheaper than an autograd
Function's Python context and node. It includes torch's headers, so it is built per torch
version, by the C++ compiler ($CXX, else c++), the first time a process needs it (about 10-20 s, with a message),
into $TD_NATIVE_CACHE, else $XDG_CACHE_HOME/tiledispatch/native, else ~/.cache/tiledispatch/native. Every later
process loads the built file. TD_NATIVE=0 turns it off. When it cannot be built, the reason is kept beside it
(NAME.failed, which stops further attempts until it is removed) and the Python paths are used: the same results,
slower.

forest.c evaluates the learned ranker's trees by leaf masks (learned.TreeEnsemble.predict's numpy path, compiled:
numpy's cost per operation rules at a bundle's size). It needs only a C compiler ($CC, else cc), is built the same
way and loaded with ctypes (forest()); without it the numpy path ranks, with the same predictions up to rounding.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

from ..caches import user_cache_dir

SOURCE = Path(__file__).with_name("torch_fastpath.cpp")
FOREST_SOURCE = Path(__file__).with_name("forest.c")
ABI_HEADER = Path(__file__).parents[1] / "include" / "tiledispatch_abi.h"  # the td_args the launch fills
MODULE = "_td_torch_fastpath"  # the name its PyInit function carries
_LOCK = threading.Lock()
_LOADED: dict = {}


def cache_dir() -> Path:
    """$TD_NATIVE_CACHE, else $XDG_CACHE_HOME/tiledispatch/native, else ~/.cache/tiledispatch/native."""
    return user_cache_dir("TD_NATIVE_CACHE", "native")


def enabled() -> bool:
    return os.environ.get("TD_NATIVE", "1").strip().lower() not in ("0", "off", "false", "no")


def torch_fastpath():
    """The compiled module (prints, eager_prints, launcher, launch, record), built if needed; None when TD_NATIVE=0
    or it cannot be built here (warned once, with the reason's file)."""
    if not enabled():
        return None
    with _LOCK:
        if "torch_fastpath" not in _LOADED:
            _LOADED["torch_fastpath"] = _load_or_build(
                built_path(), _build_command, _import, "the native torch fast path",
                "cached calls use the Python one (slower, same results)",
                "(once per torch version, about 10-20 s) ")
        return _LOADED["torch_fastpath"]


def forest():
    """The compiled tree evaluator (a ctypes library: td_forest_u32, td_forest_u64), built if needed; None when
    TD_NATIVE=0 or it cannot be built here (warned once, with the reason's file)."""
    if not enabled():
        return None
    with _LOCK:
        if "forest" not in _LOADED:
            _LOADED["forest"] = _load_or_build(forest_path(), _forest_command, _load_forest,
                                               "the native tree evaluator", "the learned ranker uses numpy (slower)")
        return _LOADED["forest"]


def forest_path() -> Path:
    """Where the tree evaluator for this source, compiler and machine is (or would be) built."""
    tag = "\n".join([FOREST_SOURCE.read_text(), os.environ.get("CC", "cc"), platform.machine()])
    return cache_dir() / f"forest-{hashlib.sha256(tag.encode()).hexdigest()[:16]}.so"


def _forest_command(output: Path) -> list[str]:
    return [*shlex.split(os.environ.get("CC", "cc")), "-O3", "-shared", "-fPIC", str(FOREST_SOURCE), "-o",
            str(output)]


def _load_forest(path: Path):
    """The library with its functions' argument types declared, or None (warned) when it does not load."""
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        warnings.warn(f"tiledispatch: {path} does not load ({error}); the learned ranker uses numpy (remove the "
                      f"file to rebuild it)", RuntimeWarning, stacklevel=3)
        return None
    i64, pointer = ctypes.c_int64, ctypes.c_void_p
    for function in (library.td_forest_u32, library.td_forest_u64):
        function.restype = ctypes.c_int
        function.argtypes = [i64, i64, i64, pointer, i64, i64, *[pointer] * 7, i64, *[pointer] * 6]
    return library


def _build_command(output: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    python_include = sysconfig.get_paths()["include"]
    libs = cpp_extension.library_paths()
    abi = int(torch.compiled_with_cxx11_abi())
    return [*shlex.split(os.environ.get("CXX", "c++")), "-O2", "-std=c++17", "-shared", "-fPIC",
            "-Wno-c++20-extensions", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{python_include}",
            f"-I{ABI_HEADER.parent}", *(f"-I{p}" for p in cpp_extension.include_paths()), str(SOURCE),
            "-o", str(output),
            *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs),
            "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10"]


def built_path() -> Path:
    """Where the module for this source, torch, Python and compiler is (or would be) built."""
    import torch

    tag = "\n".join([SOURCE.read_text(), ABI_HEADER.read_text(), torch.__version__, str(Path(torch.__file__).parent),
                     sys.version, sysconfig.get_config_var("EXT_SUFFIX") or "", os.environ.get("CXX", "c++")])
    digest = hashlib.sha256(tag.encode()).hexdigest()[:16]
    return cache_dir() / f"torch_fastpath-{digest}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def _load_or_build(target: Path, command, load, what: str, instead: str, duration: str = ""):
    """load(target), compiling it first with command(path) where it is missing; None (warned once, the reason kept
    beside it) where it cannot be built. what: how messages name it; instead: what runs without it."""
    failed = target.with_name(target.name + ".failed")
    if not target.exists():
        if failed.exists():
            return None  # warned when it failed; removing the file asks for another attempt
        reason = _build(target, command, what, duration)
        if reason is not None:
            try:
                failed.parent.mkdir(parents=True, exist_ok=True)
                failed.write_text(reason)
            except OSError:
                pass
            warnings.warn(f"tiledispatch: {what} could not be built, so {instead}; the reason is in {failed} "
                          f"(remove it to try again, or set TD_NATIVE=0)", RuntimeWarning, stacklevel=3)
            return None
    return load(target)


def _build(target: Path, make_command, what: str, duration: str) -> Optional[str]:
    """Compile into target (atomically: a process racing this one finds either nothing or the whole file);
    None on success, else what went wrong."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent, prefix=".building-")
        os.close(fd)
    except OSError as error:
        return f"cannot write the cache directory {target.parent}: {error}"
    try:
        command = make_command(Path(temporary))
        print(f"tiledispatch: compiling {what} {duration}into {target.parent}", file=sys.stderr, flush=True)
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return f"$ {shlex.join(command)}\nexit status {done.returncode}\n{done.stderr[-4000:]}"
        os.replace(temporary, target)
        return None
    except (OSError, subprocess.SubprocessError, ImportError) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _import(path: Path):
    """The built module, or None (warned) when it does not load (e.g. a file another torch left)."""
    try:
        loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
        spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except ImportError as error:
        warnings.warn(f"tiledispatch: {path} does not load ({error}); cached calls use the Python fast path "
                      f"(remove the file to rebuild it)", RuntimeWarning, stacklevel=3)
        return None


def build_now() -> dict:
    """Build (or find) the native helpers now, as `python -m tiledispatch native` does: for an image or a shared
    machine, so that no later process compiles. An explicit request tries again where an earlier attempt failed.
    RuntimeError with the compiler's complaint when one cannot be built."""
    if not enabled():
        return {"native": "off", "why": "TD_NATIVE turns it off"}
    import torch

    found = {}
    for name, what, target, get in (("forest", "tree evaluator", forest_path(), forest),
                                    ("torch_fastpath", "torch fast path", built_path(), torch_fastpath)):
        failed = target.with_name(target.name + ".failed")
        with _LOCK:
            if failed.exists():
                failed.unlink()
            _LOADED.pop(name, None)
        found[name] = target.exists()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reason is raised below
            helper = get()
        if helper is None:
            reason = failed.read_text() if failed.exists() else f"{target} does not load"
            raise RuntimeError(f"the native {what} could not be built: {reason}")
    return {"native": "loaded" if found["torch_fastpath"] else "built", "path": str(built_path()),
            "torch": torch.__version__, "forest": str(forest_path())}
