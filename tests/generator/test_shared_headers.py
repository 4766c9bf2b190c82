"""The C++ every kernel shares lives in real headers next to the ABI (runtime/tiledispatch/include): the error
helper, the dtype names and the named conv-parameter accessors are defined once, the templates include them, and
the Python side writes the conv parameters through the same named slots."""
from __future__ import annotations

import re

from conftest import REPO
from tiledispatch import abi, backends
from tiledispatch.generator import codegen, deps
from tiledispatch.generator.kernelset import expand_file

INCLUDE = REPO / "runtime" / "tiledispatch" / "include"


def test_conv_parameter_slots_agree_between_header_and_python():
    header = (INCLUDE / "tiledispatch_abi.h").read_text()
    slots = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define TD_CONV_(\w+) (\d+)", header)}
    assert slots == {"RANK": abi.CONV_RANK, "STRIDE": abi.CONV_STRIDE, "DILATION": abi.CONV_DILATION,
                     "PAD_LO": abi.CONV_PAD_LO, "PAD_HI": abi.CONV_PAD_HI}
    # three spatial dims per field fit between one slot and the next, all inside the params array
    assert sorted(slots.values()) == [0, 1, 4, 7, 10] and slots["PAD_HI"] + 3 <= abi.MAX_PARAMS


def test_templates_define_no_shared_helper_and_read_no_conv_offset():
    for path in sorted((REPO / "templates").rglob("*.j2")):
        text = path.read_text()
        assert not re.search(r"\bint32_t fail\(|\bconst char\* dtype_name\(", text), path
        assert not re.search(r"params\[\s*\d+\s*\+\s*d\s*\]", text), path


def test_every_family_includes_the_shared_header():
    seen = set()
    for backend, arch, sets in (("cpu", "x86v4", ("fp32_rcr_essential", "conv_fp16_all_essential", "layernorm_essential",
                                                  "pool_essential")),
                                ("cutlass", "sm90a", ("fp16_rcr_essential", "conv_fp16_all_essential",
                                                      "layernorm_essential", "pool_essential")),
                                ("cutlass", "sm80", ("fp16_rcr_essential", "conv_fp16_all_essential")),
                                ("ck_tile", "gfx942", ("fp16_rcr_essential", "conv_fp16_all_essential"))):
        for name in sets:
            for entry in expand_file(REPO / "preselected" / f"{name}.yaml", backend, arch):
                family = backends.family_of(entry.key)
                if (backend, family.name) in seen:
                    continue
                seen.add((backend, family.name))
                text = codegen.render(entry.key)  # includes it, directly or through a header of its folders
                included = deps.compile_inputs(entry.key)
                assert INCLUDE / "tiledispatch_kernel.h" in included, entry.key.name
                assert '#include "tiledispatch_kernel.h"' in text or any(
                    '#include "tiledispatch_kernel.h"' in p.read_text() for p in included if p.suffix in (".h", ".cuh")
                    and p.parent != INCLUDE and f'#include "{p.name}"' in text), entry.key.name
    every = {(b, f.name) for b, bk in backends.all_backends().items() for f in bk.families}
    assert seen == every, every - seen
