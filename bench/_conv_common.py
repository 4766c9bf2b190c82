"""Shared by bench/validation/validate_conv_gpu.py and bench/benchmarks/conv.py: launching one conv kernel of a bundle on torch
tensors through the C ABI (arguments built once, workspace from tiledispatch.cuda, current torch stream)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from tiledispatch import abi, backends, cuda  # noqa: E402
from tiledispatch.families.cutlass.conv_direct import few_channel  # noqa: E402
from tiledispatch.ops import conv, conv_as_gemm, gemm  # noqa: E402
from tiledispatch.plan import bind  # noqa: E402

TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def kind_of(key) -> tuple[str, ...]:
    """Which problem kinds a kernel is meant for (what validation and benchmarks try it on)."""
    alg = key.algorithm
    if alg.pipeline == "tma_ws_conv":  # CUTLASS's SM90 conv: groups = 1 only
        return ("dense", "dense_wide")
    if alg.pipeline == "implicit_gemm":
        return ("dense", "g16", "g64")
    cpg, kpg = alg.extra("cutlass.cpg", 0), alg.extra("cutlass.kpg", 0)
    if few_channel(key):  # an RGB-like input, K in partial lane blocks
        return (f"few_c{cpg}_k{kpg or alg.tile[1] + 8}",)
    specialized = {1: ("depthwise",), 2: ("g2",), 4: ("g4",), 16: ("g16",)}
    if cpg in specialized:
        return specialized[cpg]
    return ("g4", "depthwise", "multiplier", "odd")


def kind_groups(kind: str, kinds: dict) -> tuple[int, int, int]:
    """(G, C/G, K/G) of a problem kind: kinds' entry, or a few-channel kind few_c<C>_k<K> (groups = 1)."""
    if kind in kinds:
        return kinds[kind]
    c, k = kind.removeprefix("few_c").split("_k")
    return 1, int(c), int(k)


def expected_refusal(key, problem):
    """The reason a kernel documents for refusing a problem of its kinds (td_can_run must say it), or None."""
    alg = key.algorithm
    if alg.pipeline == "tma_ws_conv" and problem.direction == "bwd_data" and set(problem.stride) != {1}:
        return "unit stride"  # CUTLASS's SM90 dgrad has no strided variant; implicit_gemm covers it
    if alg.pipeline == "direct_mma" and problem.direction == "bwd_data" and set(problem.stride) != {1}:
        return "unit stride only"
    if alg.extra("cutlass.rows", 0) and (problem.stride[-1] != 1
                                         or (problem.filter_size[-1] - 1) * problem.dilation[-1] > 8):
        return "row form"  # the depthwise row form: unit stride along W, taps within 16 columns
    if alg.pipeline in ("direct", "direct_mma"):
        family = backends.family_of(key)  # its shared-memory footprint on the problem, against the arch's limit
        if family.module.problem_smem_bytes(problem, key) > backends.get(key.backend).archs[key.arch]["smem_bytes"]:
            return "bytes of shared memory"
    return None


class ConvLauncher:
    """One kernel on one problem: td_args built once, td_run per call (one launch, no sync)."""

    def __init__(self, kernel, problem, x, w, y, alpha=1.0, beta=0.0, bias=None, residuals=(),
                 clamp=conv.NO_CLAMP):
        """bias, residuals, clamp: a fused forward epilogue's operands (the problem's epilogue says which)."""
        self.kernel, self.lib = kernel, kernel.library
        _, ops = conv.operands(problem.direction, x, w, y, stride=problem.stride, dilation=problem.dilation,
                               pad_lo=problem.pad_lo, pad_hi=problem.pad_hi,
                               groups=None if x.dim() == problem.spatial_dims + 3 else problem.g,
                               bias=bias, residuals=residuals, activation=problem.epilogue.activation)
        self.args = conv.make_args(problem, kernel.key, ops, alpha=alpha, beta=beta, clamp=clamp)
        self.args.stream = torch.cuda.current_stream().cuda_stream or None
        need = self.lib.workspace_bytes(self.args)
        if need:
            self.args.workspace = cuda.workspace(need, self.args.stream or 0)
            self.args.workspace_bytes = need

    def can_run(self) -> tuple[int, str]:
        return self.lib.can_run(self.args)

    def __call__(self) -> None:
        status, reason = self.lib.run(self.args)
        if status != abi.OK:
            raise RuntimeError(f"{self.kernel.name}: status {status}: {reason}")


class PointwiseGemmLaunchers:
    """A pointwise convolution as the runtime lowers it (ops/conv_as_gemm.py): the GEMM problem over views of
    the conv's tensors, and a launcher per GEMM kernel of the registries that can run it (td_args built once)."""

    def __init__(self, problem, x, w, y, registries):
        self.problem, self.launchers = None, []
        if not conv_as_gemm.applies(problem):
            return
        _, ops = conv.operands(problem.direction, x, w, y, groups=None if x.dim() == problem.spatial_dims + 3 else 1)
        views = conv_as_gemm.operands(problem, ops)
        if views is None:
            return
        self.problem, operands = gemm.operands(*views)
        for reg in registries:
            for kern in reg.kernels:
                if self.problem.mismatch(kern.key) is None:
                    args = bind(reg, self.problem, kern, operands)
                    if kern.library.can_run(args)[0] == abi.OK:
                        self.launchers.append((reg, kern, args))

    @staticmethod
    def launch(kern, args):
        def call():
            status, reason = kern.library.run(args)
            if status != abi.OK:
                raise RuntimeError(f"{kern.name}: status {status}: {reason}")
        return call


def machine() -> dict:
    import subprocess

    props = torch.cuda.get_device_properties(0)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        smi = ""
    try:
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
        nvcc = nvcc.splitlines()[-2] if nvcc else ""
    except (OSError, subprocess.TimeoutExpired):
        nvcc = ""
    return {"gpu": props.name, "sms": props.multi_processor_count, "nvidia_smi": smi, "torch": torch.__version__,
            "cuda_torch": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "nvcc": nvcc,
            "cudart": cuda.versions()}
