import re
import textwrap

import pytest

from tiledispatch.generator import kernelset
from tiledispatch.errors import SpecError


def write(tmp_path, body: str, name: str = "myset"):
    p = tmp_path / f"{name}.yaml"
    p.write_text(textwrap.dedent(body))
    return p


BASE = """\
schema: 1
name: myset
groups:
  - backend: cpu
    op: gemm
    dtype: fp32
    layout: rcr
    pipeline: packed
    tile: [96, 256, 256]
    mma: [8, 32, 1]
"""


def expand(path, arch="x86v4"):
    return kernelset.expand_file(path, "cpu", arch)


def test_base_expands_to_one_kernel(tmp_path):
    entries = expand(write(tmp_path, BASE))
    assert len(entries) == 1
    assert entries[0].key.signature.dtype_acc == "fp32"
    assert "groups[0]" in entries[0].origin


def test_lists_expand_as_cartesian_products_with_configs_and_excludes(tmp_path):
    body = BASE.replace("dtype: fp32", "dtype: [fp32, fp16, bf16]").replace("layout: rcr", "layout: [rcr, rrr]")
    body = body.replace("tile: [96, 256, 256]", "tile: [[96, 256, 256], [48, 128, 128]]")
    body += "    epilogue: {activation: [relu, silu], bias: [true, false]}\n"
    assert len(expand(write(tmp_path, body))) == 3 * 2 * 2 * 2 * 2
    body += "exclude:\n  - {dtype: bf16}\n  - {layout: rrr, tile: [48, 128, 128]}\n"
    assert len(expand(write(tmp_path, body))) == 2 * (4 - 1) * 2 * 2
    configs = BASE.replace("    tile: [96, 256, 256]\n    mma: [8, 32, 1]\n",
                           "    configs:\n      - {tile: [96, 256, 256], mma: [8, 32, 1]}\n"
                           "      - {tile: [48, 128, 128], mma: [[6, 32, 1], [8, 32, 1]]}\n")
    assert len(expand(write(tmp_path, configs))) == 3


def test_groups_for_other_backends_and_archs_are_skipped(tmp_path):
    body = BASE.replace("  - backend: cpu\n", "  - backend: cpu\n    arch: [x86v3]\n")
    path = write(tmp_path, body)
    assert expand(path, "x86v3") and not expand(path, "x86v4")


@pytest.mark.parametrize("edit, message", [
    (("    mma: [8, 32, 1]\n", "    mma: [8, 32, 1]\n    tiles: [1, 2, 3]\n"), r"groups\[0\]: unknown field tiles"),
    (("schema: 1\n", "schema: 1\nauthor: me\n"), "unknown field author"),
    (("dtype: fp32", "dtype: fp17"), "fp17"),
    (("dtype: fp32", "dtypes: {a: fp32, b: fp32, c: fp32, acc: fp32, d: fp32}"), "dtypes: unknown field d"),
    (("pipeline: packed", "pipeline: pipelined"), r"rule cpu.pipeline: pipeline 'pipelined' is not one of packed"),
    (("mma: [8, 32, 1]", "mma: [7, 32, 1]"), r"rule cpu.mma_divides_tile"),
    (("mma: [8, 32, 1]", "mma: [8, 24, 1]"), r"rule cpu.micro_tile_n_vector"),
    (("    mma: [8, 32, 1]\n", "    mma: [8, 32, 1]\n    warps: [2, 2, 1]\n"), r"rule cpu.fixed.warps"),
    (("backend: cpu", "backend: tpu"), "backend 'tpu'"),
    (("    op: gemm\n", "    op: gemm\n    arch: x86v9\n"), "arch 'x86v9' is not an arch of backend cpu"),
    (("    pipeline: packed\n", ""), "pipeline is required"),
    (("layout: rcr", "layout: rcc"), r"rule cpu.layout: layout 'rcc' is not supported"),
    (("dtype: fp32", "dtype: fp8e4m3"), "no legal gemm combination"),
    (("    mma: [8, 32, 1]\n", "    mma: [8, 32, 1]\n    epilogue: {activation: mish}\n"), "activation: unknown value 'mish'"),
    (("    mma: [8, 32, 1]\n", "    mma: [8, 32, 1]\n    epilogue: {act: relu}\n"), "epilogue: unknown field act"),
    (("tile: [96, 256, 256]", "tile: 96"), r"tile must be \[m, n, k\]"),
    (("name: myset", "name: other"), "must match the file name"),
    (("schema: 1", "schema: 2"), "schema must be 1"),
])
def test_every_error_names_the_file_and_what_is_wrong(tmp_path, edit, message):
    old, new = edit
    assert old in BASE
    path = write(tmp_path, BASE.replace(old, new))
    with pytest.raises(SpecError) as e:
        expand(path)
    assert "myset.yaml" in str(e.value)
    assert re.search(message, str(e.value)), str(e.value)


def test_illegal_kernel_error_names_the_kernel(tmp_path):
    path = write(tmp_path, BASE.replace("mma: [8, 32, 1]", "mma: [7, 32, 1]"))
    with pytest.raises(SpecError, match=r"kernel gemm_fp32xfp32xfp32xfp32_rcr_identity_cpu_x86v4_t96x256x256_w1x1x1_i7x32x1"):
        expand(path)


def test_invalid_yaml_and_unknown_set(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("groups: [\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        expand(path)
    with pytest.raises(SpecError, match="unknown kernel set 'nosuchset'"):
        kernelset.load("nosuchset", "cpu", "x86v4")


def test_every_set_expands_for_every_target_it_declares():
    for name in kernelset.available_sets():
        for target in kernelset.targets(kernelset.find(name)):
            backend, arch = target.split("/")
            entries = kernelset.load(name, backend, arch)
            assert entries, (name, target)
            assert len({e.key for e in entries}) == len(entries)


def test_the_foundation_sets_have_cpu_kernels():
    for name in ("fp16_rcr_essential", "bf16_rcr_essential", "fp32_rcr_essential", "int8_rcr_essential",
                 "fp16_all_layouts", "fp16_rcr_fused"):
        assert kernelset.load(name, "cpu", "x86v4"), name


def test_a_set_without_kernels_for_the_target_is_an_error(tmp_path):
    path = write(tmp_path, BASE.replace("  - backend: cpu\n", "  - backend: cpu\n    arch: x86v4\n"))
    assert kernelset.load(str(path), "cpu", "x86v4")
    with pytest.raises(SpecError, match="has no kernels for backend cpu arch x86v3 .it declares: cpu/x86v4"):
        kernelset.load(str(path), "cpu", "x86v3")
