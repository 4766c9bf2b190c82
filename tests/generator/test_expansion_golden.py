"""No behaviour change across restructurings: the kernel sets expand to the kernels, keys, costs, tolerances and
legality verdicts recorded in tests/data/expansion_golden.json (scripts/expansion_golden.py), and a cpu bundle's
manifest lists the recorded kernels."""
from __future__ import annotations

import importlib.util
import json

from conftest import REPO, SESSION, scons, wait_for_prebuild

_spec = importlib.util.spec_from_file_location("expansion_golden", REPO / "scripts" / "expansion_golden.py")
golden_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden_script)
GOLDEN = json.loads(golden_script.GOLDEN.read_text())


def _differences(now: dict, then: dict, limit: int = 8) -> list[str]:
    out = [f"{name}: now {json.dumps(now.get(name))[:300]}, recorded {json.dumps(then.get(name))[:300]}"
           for name in sorted(set(now) | set(then)) if now.get(name) != then.get(name)]
    return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])


def test_every_set_expands_as_recorded():
    exp, keys = golden_script.expansions()
    assert exp == GOLDEN["expansions"], "\n".join(_differences(exp, GOLDEN["expansions"]))
    assert {n: k["json"] for n, k in GOLDEN["keys"].items()} == keys


def test_every_key_ranks_validates_and_checks_as_recorded():
    now = {}
    for name, rec in GOLDEN["keys"].items():
        key = golden_script.KernelKey.from_json(rec["json"])
        assert key.name == name
        now[name] = {"json": rec["json"], **golden_script.behaviour(key), "legality": golden_script.legality(key)}
    assert now == GOLDEN["keys"], "\n".join(_differences(now, GOLDEN["keys"]))


def test_cpu_bundle_manifest_lists_the_recorded_kernels(tmp_path):
    from tiledispatch import backends

    arch = backends.get("cpu").detect_arch()
    wait_for_prebuild()  # the session's background build has these kernels in its cache
    scons(REPO, f"kernels={golden_script.MANIFEST_SET}", "backend=cpu", f"arch={arch}", f"build_dir={tmp_path}",
          f"cache_dir={SESSION.get('cache_dir', tmp_path / 'cache')}", "bundle=b")
    assert golden_script.manifest_kernels(tmp_path / "b") == GOLDEN["manifests"][golden_script.MANIFEST_SET][arch]
