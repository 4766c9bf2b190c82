#!/usr/bin/env python3
"""The golden record of what the kernel sets expand to, written before the restructuring of issue #16.

tests/data/expansion_golden.json holds, for every set in preselected/, kernel_specs/ and bench/sets/ and every
backend/arch it declares, the kernel names in expansion order under the group that declared them; for every
key, its canonical JSON, its validation tolerance, the analytic ranker's cost on a few problems of its
signature and a digest of what the legality rules say about variants of it (other archs, tiles, warps,
instruction shapes, pipelines, schedulers, extras, dtypes); and the kernels of a cpu bundle's manifest (name,
key, file, origin) for each cpu arch. tests/generator/test_expansion_golden.py re-computes all of it
and compares: a restructuring that changes behaviour changes one of these.

    python3 scripts/expansion_golden.py --check          # compare with the record (what the test does)
    python3 scripts/expansion_golden.py --write          # rewrite the record (only for an intended change)
    python3 scripts/expansion_golden.py --write --manifests BUILD_DIR   # ... with manifests built in BUILD_DIR
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "runtime"))

from tiledispatch import selection, validation  # noqa: E402
from tiledispatch.generator import kernelset  # noqa: E402
from tiledispatch.generator import rules  # noqa: E402
from tiledispatch.spec.key import KernelKey  # noqa: E402
from tiledispatch.ops.conv import ConvProblem  # noqa: E402
from tiledispatch.ops.gemm import GemmProblem  # noqa: E402
from tiledispatch.ops.layernorm import LayerNormProblem  # noqa: E402
from tiledispatch.ops.maxpool import problem_of as maxpool_problem  # noqa: E402

GOLDEN = REPO / "tests" / "data" / "expansion_golden.json"
HEADER = ("Pre-restructuring record (issue #16), written by scripts/expansion_golden.py before the generator/runtime "
          "split: what every kernel set expands to, each key's ranker costs and tolerance, a digest of the legality "
          "rules' verdicts on variants of each key, and a cpu bundle's manifest kernels. It must not change.")
SET_DIRS = ("preselected", "kernel_specs", "bench/sets")
MANIFEST_SET = "fp16_rcr_essential"
CPU_ARCHS = ("generic", "x86v3", "x86v4")

LAYERNORM_SHAPES = ((100352, 96), (1568, 768), (4096, 4096), (7, 1000))
# (n, c, in_size, window, stride, padding): ResNet's stem pool, a 2 x 2 pool, 1D and 3D
MAXPOOL_SHAPES = ((32, 64, (112, 112), 3, 2, 1), (8, 24, (7, 9), 2, 2, 0), (4, 3, (100,), 3, 1, 1),
                  (2, 16, (8, 16, 16), 2, 2, 0))
GEMM_SHAPES = ((1000, 512, 256, 1), (4096, 4096, 4096, 1), (7, 4096, 4096, 1), (128, 128, 128, 8), (3000, 50, 9000, 1))
# (n, g, c, k, in_size, filter, stride, dilation, pad) in 2D; 1D / 3D keep the last one / add a depth
CONV_SHAPES = ((8, 1, 64, 64, (56, 56), (3, 3), 1, 1, 1), (2, 1, 128, 256, (28, 28), (3, 3), 2, 1, 1),
               (4, 1, 256, 64, (14, 14), (1, 1), 1, 1, 0), (8, 64, 64, 64, (56, 56), (3, 3), 1, 1, 1),
               (2, 96, 96, 96, (28, 28), (7, 7), 1, 1, 3), (4, 32, 128, 128, (28, 28), (3, 3), 1, 2, 2))


def set_files() -> list[Path]:
    return [p for d in SET_DIRS for p in sorted((REPO / d).glob("*.yaml"))]


def expansions() -> tuple[dict, dict]:
    """({set file: {backend/arch: [[origin, [name, ...]], ...]}} in expansion order, {name: key JSON})."""
    out, keys = {}, {}
    for path in set_files():
        per = {}
        for target in kernelset.targets(path):
            backend, arch = target.split("/")
            groups = per[target] = []
            for e in kernelset.expand_file(path, backend, arch):
                if not groups or groups[-1][0] != e.origin:
                    groups.append([e.origin, []])
                groups[-1][1].append(e.key.name)
                keys[e.key.name] = e.key.to_json()
        out[str(path.relative_to(REPO))] = per
    return out, dict(sorted(keys.items()))


def problems(key: KernelKey) -> list:
    sig = key.signature
    if sig.op == "gemm":
        return [GemmProblem(m, n, k, sig.dtype_a, sig.dtype_b, sig.dtype_c, sig.layout, batch, sig.epilogue)
                for m, n, k, batch in GEMM_SHAPES]
    if sig.op == "layernorm":
        return [LayerNormProblem(rows, cols, sig.dtype_a, sig.dtype_b, sig.dtype_c) for rows, cols in LAYERNORM_SHAPES]
    if sig.op == "maxpool":
        return [maxpool_problem(n, c, size, sig.dtype_a, window, stride, padding)
                for n, c, size, window, stride, padding in MAXPOOL_SHAPES]
    out = []
    for n, g, c, k, size, filt, s, d, p in CONV_SHAPES:
        rank = sig.spatial_dims
        size, filt = (size[-1:], filt[-1:]) if rank == 1 else ((8, *size), (3, *filt)) if rank == 3 else (size, filt)
        out.append(ConvProblem(sig.direction, n, g, c, k, size, filt, s, d, p, p, sig.dtype_a, sig.dtype_b,
                               sig.dtype_c, epilogue=sig.epilogue))
    return out


def _call(fn, *args):
    try:
        value = fn(*args)
    except Exception as e:  # noqa: BLE001 - the record keeps what happened, errors included
        return f"{type(e).__name__}: {e}"
    return repr(value) if isinstance(value, float) and not math.isfinite(value) else value


def behaviour(key: KernelKey) -> dict:
    """What the runtime derives from a key: its validation tolerance and the analytic cost per problem."""
    return {"tolerance": _call(validation.tolerance, key),
            "cost": [_call(selection.estimated_cost, p, key) for p in problems(key)]}


def _variants(key: KernelKey):
    """(label, thunk building a variant key) for the legality record."""
    alg, sig = key.algorithm, key.signature
    data = rules.backend_rules(key.backend)

    def triple(t, axis, f):
        t = list(t)
        t[axis] = f(t[axis])
        return tuple(t)

    def alg_(**changes):
        return lambda: key.replace(algorithm=dataclasses.replace(alg, **changes))

    for arch in rules.archs(key.backend):
        if arch != key.arch:
            yield f"arch={arch}", (lambda a=arch: key.replace(arch=a))
    for field in ("tile", "warps", "mma", "cluster"):
        for axis in range(3):
            yield f"{field}[{axis}]*2", alg_(**{field: triple(getattr(alg, field), axis, lambda v: v * 2)})
            if getattr(alg, field)[axis] > 1:
                yield f"{field}[{axis}]/2", alg_(**{field: triple(getattr(alg, field), axis, lambda v: max(1, v // 2))})
    for name in ("pipeline", "scheduler"):
        for value in data[name]:
            if value != getattr(alg, name):
                yield f"{name}={value}", alg_(**{name: value})
    yield "stages", alg_(stages=0 if alg.stages else 3)
    yield "split_k=2", alg_(split_k=2)
    extras = dict(alg.extras)
    for fname, spec in (data.get("extras") or {}).items():
        full = f"{key.backend}.{fname}"
        values = {"bool": [False, True], "int": [0, 1, 2, 4, 8, 16], "enum": spec.get("values", [])}[spec["type"]]
        for value in values:
            if extras.get(full, spec.get("default")) != value:
                yield f"{fname}={value}", alg_(extras=tuple({**extras, full: value}.items()))
    yield "relu+bias", lambda: key.replace(signature=dataclasses.replace(
        sig, epilogue=dataclasses.replace(sig.epilogue, activation="relu", bias=True)))
    for combo in data["dtypes"][sig.op]:
        if combo != [sig.dtype_a, sig.dtype_b, sig.dtype_c, sig.dtype_acc]:
            yield "dtypes=" + "/".join(combo), lambda c=combo: key.replace(signature=dataclasses.replace(
                sig, dtype_a=c[0], dtype_b=c[1], dtype_c=c[2], dtype_acc=c[3]))


def legality(key: KernelKey) -> str:
    """A digest of [label, verdict] for every variant of the key: a verdict is the violated rules' messages (as a
    set: rules that live in different files are reported in file order), or the error that building the variant
    key or evaluating a rule raised."""
    record = []
    for label, make in _variants(key):
        try:
            verdict = sorted(str(v) for v in rules.check(make()))
        except Exception as e:  # noqa: BLE001
            verdict = f"{type(e).__name__}: {e}"
        record.append([label, verdict])
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def manifest_kernels(bundle_dir: Path) -> list[dict]:
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    return [{k: e[k] for k in ("name", "key", "file", "origin")} for e in manifest["kernels"]]


def record(manifests: dict | None = None) -> dict:
    exp, keys = expansions()
    per_key = {}
    for name, text in keys.items():
        key = KernelKey.from_json(text)
        per_key[name] = {"json": text, **behaviour(key), "legality": legality(key)}
    out = {"header": HEADER, "expansions": exp, "keys": per_key}
    if manifests is not None:
        out["manifests"] = manifests
    return out


def dump(rec: dict) -> str:
    """The record as JSON with one line per set target, key and manifest (readable diffs, a compact file)."""
    def section(d: dict, indent: str, depth: int) -> str:
        lines = []
        for name, value in sorted(d.items()):
            inner = (section(value, indent + " ", depth - 1) if depth > 1 and isinstance(value, dict)
                     else json.dumps(value, sort_keys=True, separators=(",", ":")))
            lines.append(f"{indent} {json.dumps(name)}: {inner}")
        return "{\n" + ",\n".join(lines) + f"\n{indent}}}"
    depth = {"expansions": 2, "manifests": 2}
    parts = [f" {json.dumps(k)}: " + (section(v, " ", depth.get(k, 1)) if isinstance(v, dict) else json.dumps(v))
             for k, v in sorted(rec.items())]
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite tests/data/expansion_golden.json")
    ap.add_argument("--check", action="store_true", help="compare with the record")
    ap.add_argument("--manifests", type=Path, help=f"a build_dir holding {MANIFEST_SET} built as "
                    f"<build_dir>/<arch> for each cpu arch ({', '.join(CPU_ARCHS)})")
    a = ap.parse_args()
    if a.write:
        manifests = None
        if a.manifests:
            manifests = {MANIFEST_SET: {arch: manifest_kernels(a.manifests / arch) for arch in CPU_ARCHS}}
        elif GOLDEN.is_file():
            manifests = json.loads(GOLDEN.read_text()).get("manifests")
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(dump(record(manifests)))
        print(f"wrote {GOLDEN}")
        return 0
    golden = json.loads(GOLDEN.read_text())
    now = record(golden.get("manifests"))
    bad = [part for part in ("expansions", "keys") if now[part] != golden[part]]
    print("differs: " + ", ".join(bad) if bad else "matches the golden record")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
