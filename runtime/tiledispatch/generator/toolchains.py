"""Toolchains: how a backend's rendered sources become kernels (the generator's half of a backend).

A backend's toolchain is the module templates/<backend>/toolchain.py (package tiledispatch.families.<backend>),
next to its templates; the runtime never imports it. It provides TOOLCHAIN_API:

  SOURCE_SUFFIX                 suffix of rendered sources (".cpp", ".cu")
  JOB_MEMORY_BYTES              peak memory of one compile, used to cap parallel jobs
  toolchain() -> Toolchain      what was found: compiler and third-party versions (enter every build identity)
  compile_flags(key, tc) -> [str]   compile flags (no paths: these enter the build identity)
  compile_command(key, tc, source, output, include_dirs) -> [str]
  available() -> (bool, str)    toolchain present (detection), for backend=auto, with the reason

optionally LINK_API: object_command(key, tc, source, output, include_dirs) (compile only) and
link_command(key, tc, object, output); with both, the build compiles and links in two steps, so that a compiler
launcher (scons launcher=ccache) runs on the compile, the step compiler caches can cache;

and, where the backend has a compile-check mode (scons check=1), CHECK_API: check_toolchain() and
check_command(key, tc, source, output). get() checks the module when it is first loaded and names what is missing
in one line; check() names a backend without a check mode in one line.
"""
from __future__ import annotations

import functools
import importlib
import subprocess
from dataclasses import dataclass
from types import ModuleType

from .. import backends

TOOLCHAIN_API = ("SOURCE_SUFFIX", "JOB_MEMORY_BYTES", "toolchain", "compile_flags", "compile_command", "available")
CHECK_API = ("check_toolchain", "check_command")
LINK_API = ("object_command", "link_command")


@dataclass(frozen=True)
class Toolchain:
    compiler: str                 # path or command of the compiler
    identity: str                 # every version string that enters the build identity
    include_dirs: tuple[str, ...] = ()   # third-party headers (-isystem: never scanned)


class ToolchainError(RuntimeError):
    """A backend whose toolchain module does not provide what the build calls."""


def tool_output(cmd: list[str], what: str) -> str:
    """The output of a toolchain probe such as `compiler --version`; RuntimeError on one line, naming the
    command, when it cannot run, fails or prints nothing (a compiler that exists but does not work)."""
    shown = " ".join(cmd)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{what}: `{shown}` cannot run: {e}") from None
    out = (proc.stdout or proc.stderr).strip()
    if proc.returncode != 0 or not out:
        last = proc.stderr.strip().splitlines()[-1:]
        raise RuntimeError(f"{what}: `{shown}` failed (exit {proc.returncode})" + (f": {last[0]}" if last else ""))
    return out


def missing(module: ModuleType, api) -> list[str]:
    """The names of `api` the module lacks (constants must exist, functions must be callable)."""
    return [name for name in api if not hasattr(module, name)
            or (not name.isupper() and not callable(getattr(module, name)))]


@functools.lru_cache(maxsize=None)
def get(name: str) -> ModuleType:
    """The toolchain module of backend `name`; ToolchainError naming what it lacks."""
    backend = backends.get(name)  # ValueError naming the known backends
    module = importlib.import_module(f"{backends.FAMILIES_PACKAGE}.{backend.name}.toolchain")
    lacking = missing(module, TOOLCHAIN_API)
    if lacking:
        raise ToolchainError(f"backend {name}: its toolchain ({module.__file__}) defines no {', '.join(lacking)} "
                             f"(the Toolchain interface, {__name__})")
    return module


def check(name: str) -> ModuleType:
    """The toolchain module of a backend that has a compile-check mode; ToolchainError in one line otherwise."""
    module = get(name)
    lacking = missing(module, CHECK_API)
    if len(lacking) == len(CHECK_API):
        raise ToolchainError(f"backend {name} has no compile-check mode (check=1 is for backends that can check "
                             f"sources without building them: "
                             f"{', '.join(n for n in backends.names() if not missing(get(n), CHECK_API)) or 'none'}); "
                             f"build without check=1")
    if lacking:
        raise ToolchainError(f"backend {name}: its toolchain ({module.__file__}) has a check mode without "
                             f"{', '.join(lacking)} (the Toolchain interface, {__name__})")
    return module


def available(name: str) -> tuple[bool, str]:
    """Whether the backend's toolchain and a device it runs on are present, and what was found or is missing."""
    ok, why = get(name).available()
    if not ok:
        return ok, why
    present, device = backends.get(name).driver.present()
    return (True, f"{why}; {device}") if present else (False, device)


def auto_select() -> tuple[str, list[str]]:
    """The available backend of highest auto_priority, and why each better one was not."""
    reasons = []
    for name in backends.auto_order():
        ok, why = available(name)
        if ok:
            return name, reasons
        reasons.append(f"{name}: {why}")
    raise RuntimeError("no backend is available: " + "; ".join(reasons))
