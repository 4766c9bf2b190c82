"""Device drivers: what the runtime asks of the device a backend's kernels run on.

A Driver says where the kernels' data lives (`device`, the kind arrays.view reports for an array on it), which
arch this machine's device is and whether it can run kernels built for an arch (from the backend's arch facts,
templates/<backend>/__init__.py: cpu_flags, cc), who the device is for tuning records (identity), which stream the
caller's framework runs on (stream) and how to allocate device bytes next to an array (allocate: the registry keeps
one workspace per device and stream with it). A backend registers one (backends.register), which checks that it
defines every method of DRIVER_API and names what is missing in one line. Nothing here touches a GPU at import.
"""
from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any, Mapping, Optional

DRIVER_API = ("present", "detect_arch", "runnable", "identity", "stream", "allocate")


class Driver:
    """device: where the kernels' data lives ("cpu", "cuda", "hip")."""
    device = ""

    def identity(self) -> str:
        """What a tuning record is valid for: the device's model and size."""
        raise NotImplementedError

    def stream(self, like: Any) -> Optional[int]:
        """The stream the framework that owns array `like` runs on now (None: the default stream, or none)."""
        from .plan import current_stream  # the framework lookup (torch, cupy) lives with the plans that use it

        return current_stream(like)

    def allocate(self, nbytes: int, like: Any):
        """nbytes of device memory from the framework that owns `like` (torch or cupy), an object that owns it."""
        from .errors import InvalidInputError

        module = type(like).__module__
        if module.startswith("torch"):
            import torch

            return torch.empty(nbytes, dtype=torch.uint8, device=like.device)
        if module.startswith("cupy"):
            import cupy

            return cupy.empty(nbytes, dtype=cupy.uint8)
        raise InvalidInputError("this kernel needs a device workspace: pass torch or cupy arrays")

    def present(self) -> tuple[bool, str]:
        """Whether this machine has such a device, and what was found or is missing."""
        raise NotImplementedError

    def detect_arch(self, archs: Mapping[str, Mapping]) -> Optional[str]:
        """The arch (one of `archs`) of this machine's device, or None without a supported one."""
        raise NotImplementedError

    def runnable(self, arch: str, archs: Mapping[str, Mapping]) -> tuple[bool, str]:
        """Whether this machine can run kernels built for arch, and why not."""
        raise NotImplementedError


# ---- cpu ------------------------------------------------------------------------------------------------------

def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return model


class CpuDriver(Driver):
    """The host CPU; an arch's `cpu_flags` are the /proc/cpuinfo flags it needs. Kernels run on the caller's
    thread: no streams (and the cpu kernels ask for no workspace)."""
    device = "cpu"

    def identity(self) -> str:
        return f"cpu:{cpu_model()}:{os.cpu_count()} cpus"

    def stream(self, like) -> Optional[int]:
        return None

    def present(self) -> tuple[bool, str]:
        return True, "the host CPU"

    def detect_arch(self, archs) -> Optional[str]:
        """The last arch (archs are listed by capability) whose flags this CPU has."""
        have = cpu_flags()
        fitting = [a for a, info in archs.items() if set(info.get("cpu_flags", ())) <= have]
        return fitting[-1] if fitting else None

    def runnable(self, arch, archs) -> tuple[bool, str]:
        missing = set(archs.get(arch, {}).get("cpu_flags", ())) - cpu_flags()
        if missing:
            return False, f"this CPU lacks {', '.join(sorted(missing))}, needed by cpu arch {arch}"
        return True, ""


# ---- cuda -----------------------------------------------------------------------------------------------------

def arch_of_cc(cc: str, archs: Mapping[str, Mapping]) -> Optional[str]:
    """The arch for a device of compute capability cc ("9.0"): the one whose `cc` it is, else one that carries
    PTX (`ptx`, JIT-compiled by the driver on newer GPUs) for an earlier capability of the same major version."""
    for arch, info in archs.items():
        if info.get("cc") == cc:
            return arch
    major, minor = _cc(cc)
    for arch, info in archs.items():
        if info.get("ptx") and _cc(info["cc"])[0] == major and _cc(info["cc"]) <= (major, minor):
            return arch
    return None


def _cc(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


@functools.lru_cache(maxsize=None)
def _smi_compute_capability() -> Optional[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


class CudaDriver(Driver):
    """NVIDIA GPUs through the CUDA runtime (cuda.py); an arch's `cc` is the compute capability it is built for,
    `ptx` that it also carries PTX, which newer GPUs JIT-compile."""
    device = "cuda"

    def identity(self) -> str:
        from . import cuda

        return f"cuda:{cuda.device_name()}:{cuda.multiprocessor_count()} SMs"

    def present(self) -> tuple[bool, str]:
        if os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None:
            return True, "an NVIDIA GPU"
        return False, "no NVIDIA GPU (/dev/nvidia0, nvidia-smi)"

    def detect_arch(self, archs) -> Optional[str]:
        cc = _smi_compute_capability()
        return arch_of_cc(cc, archs) if cc else None

    def runnable(self, arch, archs) -> tuple[bool, str]:
        cc = _smi_compute_capability()
        if cc is None:
            return False, "no NVIDIA GPU found (nvidia-smi)"
        info = archs.get(arch)
        if info is None:
            return False, f"unknown cutlass arch {arch!r}"
        if _cc(cc) == _cc(info["cc"]) or (info.get("ptx") and _cc(cc) >= _cc(info["cc"])):
            return True, ""
        need = f">= {info['cc']}" if info.get("ptx") else info["cc"]
        return False, f"{arch} kernels need compute capability {need}, this GPU has {cc}"


# ---- hip ------------------------------------------------------------------------------------------------------

def rocm_path() -> Path:
    return Path(os.environ.get("ROCM_PATH", "/opt/rocm"))


@functools.lru_cache(maxsize=None)
def _rocminfo() -> str:
    tool = shutil.which("rocminfo") or str(rocm_path() / "bin" / "rocminfo")
    try:
        return subprocess.run([tool], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


class HipDriver(Driver):
    """AMD GPUs through ROCm; rocminfo names the gfx arch of each agent."""
    device = "hip"

    def identity(self) -> str:
        for line in _rocminfo().splitlines():  # the first GPU agent's marketing name
            if "Marketing Name" in line and "CPU" not in line:
                return f"hip:{line.split(':', 1)[1].strip()}"
        return "hip:unknown"

    def present(self) -> tuple[bool, str]:
        if os.path.exists("/dev/kfd"):
            return True, "an AMD GPU (/dev/kfd)"
        return False, "no AMD GPU (/dev/kfd missing)"

    def detect_arch(self, archs) -> Optional[str]:
        """The first gfx arch rocminfo lists that is one of archs."""
        for line in _rocminfo().splitlines():
            for word in line.replace(":", " ").split():
                if word in archs:
                    return word
        return None

    def runnable(self, arch, archs) -> tuple[bool, str]:
        found = self.detect_arch(archs)
        if found is None:
            return False, "no AMD GPU found (rocminfo lists no gfx9 agent)"
        if found != arch:
            return False, f"this machine's GPU is {found}, kernels are built for {arch}"
        return True, ""
