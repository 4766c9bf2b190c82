"""The full ck_tile compile check, as CI runs it: `scons ... backend=ck_tile check=1` over every
preselected set with ck_tile kernels, for each arch. A front-end and IR-generation check, not a build."""
import os
from pathlib import Path

import pytest

from conftest import REPO, scons, summary
from tiledispatch.generator import kernelset
from tiledispatch.generator import toolchains

ck_tile = toolchains.get("ck_tile")

ARCHS = ("gfx90a", "gfx942", "gfx950")


def sets_for(arch: str) -> list[str]:
    return [name for name in kernelset.available_sets()
            if f"ck_tile/{arch}" in kernelset.targets(kernelset.find(name))]


@pytest.fixture(scope="module")
def toolchain():
    try:
        return ck_tile.check_toolchain()
    except RuntimeError as e:
        pytest.skip(f"ck_tile check toolchain not installed (bash .ci/install_ck_check.sh): {e}")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_every_preselected_ck_tile_kernel_passes_the_check(toolchain, arch, tmp_path):
    sets = sets_for(arch)
    assert sets, f"no preselected set has ck_tile kernels for {arch}"
    expected = len(kernelset.load(sets, "ck_tile", arch))
    # the results are cached with the check's tools when TD_CK_CHECK_DIR names them (CI keeps that folder
    # between runs and may run the tests with an empty HOME), else in the default cache
    cache = [f"cache_dir={Path(os.environ['TD_CK_CHECK_DIR']) / 'scons'}"] if os.environ.get("TD_CK_CHECK_DIR") else []
    proc = scons(REPO, f"kernels={','.join(sets)}", "backend=ck_tile", f"arch={arch}", "check=1",
                 f"build_dir={tmp_path}", *cache, check=False)
    counts = summary(proc)
    assert proc.returncode == 0 and counts["failed"] == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert counts["total"] == expected and counts["compiled"] + counts["cached"] + counts["up_to_date"] == expected
