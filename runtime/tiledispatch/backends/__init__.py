"""Backends: one small module each, loaded by name; the core names none of them.

A backend module provides:

  SOURCE_SUFFIX                 suffix of rendered sources (".cpp", ".cu")
  JOB_MEMORY_BYTES              peak memory of one compile, used to cap parallel jobs
  templates(key) -> [str]       template names under templates/<backend>/ the key's source uses,
                                main template first (rendering any other one is an error)
  context(key) -> dict          the symbol map: values the templates see (C++ types, constants)
  toolchain() -> Toolchain      compiler and third-party versions (enter every build identity)
  compile_flags(key, tc) -> [str]   compile flags (no paths: these enter the build identity)
  compile_command(key, tc, source, output, include_dirs) -> [str]
  available() -> (bool, str)    toolchain and device present, for backend=auto, with the reason
  detect_arch() -> str | None   the arch of this machine's device, for arch=auto
  runnable(arch) -> (bool, str) whether this machine can run kernels built for arch
"""
from __future__ import annotations

import importlib
import subprocess
from dataclasses import dataclass
from types import ModuleType

from ..spec import rules


@dataclass(frozen=True)
class Toolchain:
    compiler: str                 # path or command of the compiler
    identity: str                 # every version string that enters the build identity
    include_dirs: tuple[str, ...] = ()   # third-party headers (-isystem: never scanned)


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


def names() -> list[str]:
    return list(rules.all_rules())


def auto_select() -> tuple[str, list[str]]:
    """The available backend of highest auto_priority (rules data), and why each better one was not."""
    reasons = []
    ranked = sorted(names(), key=lambda n: -rules.backend_rules(n).get("auto_priority", 0))
    for name in ranked:
        ok, why = get(name).available()
        if ok:
            return name, reasons
        reasons.append(f"{name}: {why}")
    raise RuntimeError("no backend is available: " + "; ".join(reasons))


def get(name: str) -> ModuleType:
    if name not in rules.all_rules():
        raise ValueError(f"unknown backend {name!r} (known: {', '.join(names())})")
    return importlib.import_module(f"{__name__}.{name}")
