"""Write the kernel set a sweep builds from a preselected set: its groups of one backend and op, with every epilogue
left out (identity), so each tile of the set is timed on the suites' plain problems. Neither the epilogue nor the
dtype is a model feature (learned.py): the model that knows a tile ranks its fused kernels too.

    python bench/sweeps/identity_set.py conv_fp16_all_essential --backend cutlass --op conv -o build/conv_sweep.yaml
    scons kernels=build/conv_sweep.yaml backend=cutlass arch=sm90a bundle=conv_sweep
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "runtime"))

from tiledispatch.generator import kernelset  # noqa: E402


def identity_set(source: Path, backend: str, op: str, name: str) -> dict:
    spec = yaml.safe_load(source.read_text())
    groups = []
    for group in spec["groups"]:
        if group.get("backend") != backend or group.get("op") != op:
            continue
        group = {k: v for k, v in group.items() if k != "epilogue"}
        if "configs" in group:
            group["configs"] = [{k: v for k, v in c.items() if k != "epilogue"} for c in group["configs"]]
        groups.append(group)
    if not groups:
        raise SystemExit(f"{source}: no {backend} {op} groups")
    return {"schema": spec.get("schema", 1), "name": name,
            "description": f"{spec['name']}'s {backend} {op} kernels with identity epilogues, for the sweeps",
            "groups": groups}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("set", help="a preselected set's name or a set file")
    ap.add_argument("--backend", default="cutlass")
    ap.add_argument("--op", default="conv", choices=("gemm", "conv"))
    ap.add_argument("-o", "--out", required=True, help="the set file to write (its name is the set's)")
    a = ap.parse_args(argv)
    source = kernelset.find(a.set)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(identity_set(source, a.backend, a.op, out.stem), sort_keys=False))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
