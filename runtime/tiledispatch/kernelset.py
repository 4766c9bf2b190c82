"""Kernel sets: YAML files that declare kernels, expanded into kernel keys.

    schema: 1
    name: fp16_rcr_essential
    description: one line
    groups:                      # each group expands to the cartesian product of its list fields
      - backend: cpu             # required
        arch: [x86v4]            # optional; omitted = every arch of the backend
        op: gemm
        dtype: fp16              # shorthand, or dtypes: {a, b, c, acc}
        layout: [rcr, rrr]
        epilogue: {activation: [relu, gelu_tanh], bias: true}
        tile: [[96, 256, 256], [48, 256, 256]]   # triples: [m, n, k] is one value, a list of them a product
        mma: [8, 32, 1]
        pipeline: packed
        configs:                 # optional explicit list, each entry merged over the group
          - {tile: [64, 128, 128]}
    exclude:                     # optional: drop kernels matching every given field
      - {layout: rrr, tile: [48, 256, 256]}

Validation is strict: an unknown field, an unknown value or an illegal combination is a SpecError
naming the file, the group and the kernel, and the rule it breaks.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import SpecError
from .spec import rules
from .spec.key import Algorithm, Epilogue, KernelKey, Signature

SET_SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[2]
SEARCH_DIRS = (REPO_ROOT / "preselected", REPO_ROOT / "kernel_specs")

TOP_FIELDS = {"schema", "name", "description", "groups", "exclude"}
SELECT_FIELDS = {"backend", "arch"}
SIG_FIELDS = {"op", "direction", "spatial_dims", "dtype", "dtypes", "layout", "epilogue"}
TRIPLE_FIELDS = {"tile", "warps", "mma", "cluster"}
ALG_FIELDS = TRIPLE_FIELDS | {"pipeline", "scheduler", "split_k", "stages", "extras"}
KERNEL_FIELDS = SIG_FIELDS | ALG_FIELDS
GROUP_FIELDS = SELECT_FIELDS | KERNEL_FIELDS | {"configs"}
EPILOGUE_FIELDS = {"activation", "bias", "residuals"}
DTYPES_FIELDS = {"a", "b", "c", "acc"}


@dataclass(frozen=True)
class KernelEntry:
    key: KernelKey
    origin: str          # "<file>: groups[i]" (and ".configs[j]")


def find(spec: str) -> Path:
    """A kernel set by file path, or by name in preselected/ or kernel_specs/."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise SpecError(f"kernel set file {spec} does not exist")
        return path
    for d in SEARCH_DIRS:
        candidate = d / f"{spec}.yaml"
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for d in SEARCH_DIRS for p in d.glob("*.yaml"))
    raise SpecError(f"unknown kernel set {spec!r} (known: {', '.join(known)}; or give a .yaml path)")


def available_sets() -> dict[str, str]:
    """name -> description of every preselected and example set."""
    out = {}
    for d in SEARCH_DIRS:
        for p in sorted(d.glob("*.yaml")):
            data = yaml.safe_load(p.read_text()) or {}
            out[p.stem] = data.get("description", "")
    return out


def load(specs, backend: str, arch: str) -> list[KernelEntry]:
    """Every kernel of the given sets for one backend and arch, without duplicates, in order."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s]
    if not specs:
        raise SpecError("no kernel set given (kernels=<set|file.yaml>[,...])")
    seen: dict[KernelKey, KernelEntry] = {}
    for spec in specs:
        entries = expand_file(find(spec), backend, arch)
        if not entries:
            raise SpecError(f"kernel set {spec} has no kernels for backend {backend} arch {arch} "
                            f"(it declares: {', '.join(targets(find(spec))) or 'nothing'})")
        for entry in entries:
            seen.setdefault(entry.key, entry)
    return list(seen.values())


def targets(path: Path) -> list[str]:
    """The backend/arch pairs a set file declares kernels for."""
    data = yaml.safe_load(path.read_text()) or {}
    out = []
    for group in data.get("groups") or []:
        backend = group.get("backend")
        if backend in rules.all_rules():
            for a in _as_list(group.get("arch", list(rules.archs(backend)))):
                if f"{backend}/{a}" not in out:
                    out.append(f"{backend}/{a}")
    return out


def expand_file(path: Path, backend: str, arch: str) -> list[KernelEntry]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {e}") from None
    where = _display(path)
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a mapping with schema, name, groups")
    _no_unknown(where, data, TOP_FIELDS)
    if data.get("schema") != SET_SCHEMA_VERSION:
        raise SpecError(f"{where}: schema must be {SET_SCHEMA_VERSION}, got {data.get('schema')!r}")
    if data.get("name") != path.stem:
        raise SpecError(f"{where}: name {data.get('name')!r} must match the file name {path.stem!r}")
    groups = data.get("groups")
    if not isinstance(groups, list) or not groups:
        raise SpecError(f"{where}: groups must be a non-empty list")
    excludes = data.get("exclude") or []
    if not isinstance(excludes, list):
        raise SpecError(f"{where}: exclude must be a list of mappings")
    for i, ex in enumerate(excludes):
        if not isinstance(ex, dict):
            raise SpecError(f"{where}: exclude[{i}] must be a mapping")
        _no_unknown(f"{where}: exclude[{i}]", ex, SELECT_FIELDS | KERNEL_FIELDS)
    if backend not in rules.all_rules():
        raise SpecError(f"unknown backend {backend!r} (known: {', '.join(rules.all_rules())})")

    out = []
    for gi, group in enumerate(groups):
        gwhere = f"{where}: groups[{gi}]"
        if not isinstance(group, dict):
            raise SpecError(f"{gwhere}: expected a mapping")
        _no_unknown(gwhere, group, GROUP_FIELDS)
        group_backend = group.get("backend")
        if group_backend not in rules.all_rules():
            raise SpecError(f"{gwhere}: backend {group_backend!r} is not one of {', '.join(rules.all_rules())}")
        archs = _as_list(group.get("arch", list(rules.archs(group_backend))))
        for a in archs:
            if a not in rules.archs(group_backend):
                raise SpecError(f"{gwhere}: arch {a!r} is not an arch of backend {group_backend} "
                                f"(known: {', '.join(rules.archs(group_backend))})")
        if group_backend != backend or arch not in archs:
            continue
        configs = group.get("configs", [{}])
        if not isinstance(configs, list) or not configs:
            raise SpecError(f"{gwhere}: configs must be a non-empty list of mappings")
        base = {k: v for k, v in group.items() if k not in GROUP_FIELDS - KERNEL_FIELDS}
        for ci, cfg in enumerate(configs):
            cwhere = gwhere + (f".configs[{ci}]" if "configs" in group else "")
            if not isinstance(cfg, dict):
                raise SpecError(f"{cwhere}: expected a mapping")
            _no_unknown(cwhere, cfg, KERNEL_FIELDS)
            for fields in _product({**base, **cfg}, cwhere):
                key = _make_key(fields, backend, arch, cwhere)
                if any(_matches(key, ex) for ex in excludes):
                    continue
                violations = rules.check(key)
                if violations:
                    raise SpecError(f"{cwhere}: kernel {key.name} is illegal: " + "; ".join(map(str, violations)))
                out.append(KernelEntry(key, cwhere))
    return out


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _no_unknown(where: str, d: dict, allowed: set) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise SpecError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                        f"(allowed: {', '.join(sorted(allowed))})")


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _choices(name: str, value: Any, where: str) -> list:
    """The alternatives one field stands for."""
    if name in TRIPLE_FIELDS:
        if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            return [tuple(v) for v in value]
        if isinstance(value, list):
            return [tuple(value)]
        raise SpecError(f"{where}: {name} must be [m, n, k] or a list of them, got {value!r}")
    if name in ("epilogue", "extras", "dtypes"):
        alternatives = value if isinstance(value, list) else [value]
        out = []
        for alt in alternatives:
            if not isinstance(alt, dict):
                raise SpecError(f"{where}: {name} must be a mapping or a list of mappings, got {alt!r}")
            if name == "epilogue":
                _no_unknown(f"{where}: epilogue", alt, EPILOGUE_FIELDS)
            if name == "dtypes":
                _no_unknown(f"{where}: dtypes", alt, DTYPES_FIELDS)
            keys = sorted(alt)
            for combo in itertools.product(*(_as_list(alt[k]) for k in keys)):
                out.append(dict(zip(keys, combo)))
        return out
    return _as_list(value)


def _product(fields: dict, where: str):
    names = sorted(fields)
    for combo in itertools.product(*(_choices(n, fields[n], where) for n in names)):
        yield dict(zip(names, combo))


def _make_key(f: dict, backend: str, arch: str, where: str) -> KernelKey:
    data = rules.backend_rules(backend)
    fixed = data.get("fixed") or {}
    try:
        op = f.get("op")
        if op is None:
            raise ValueError("op is required")
        if ("dtype" in f) == ("dtypes" in f):
            raise ValueError("give exactly one of dtype (shorthand) or dtypes {a, b, c, acc}")
        if "dtype" in f:
            a, b, c, acc = rules.default_acc_combo(backend, op, f["dtype"])
        else:
            missing = DTYPES_FIELDS - set(f["dtypes"])
            if missing:
                raise ValueError(f"dtypes is missing {', '.join(sorted(missing))}")
            a, b, c, acc = (f["dtypes"][r] for r in ("a", "b", "c", "acc"))
        for required in ("layout", "tile", "pipeline"):
            if required not in f:
                raise ValueError(f"{required} is required")
        epi = Epilogue(**f.get("epilogue", {}))
        sig = Signature(op=op, dtype_a=a, dtype_b=b, dtype_c=c, dtype_acc=acc, layout=f["layout"],
                        epilogue=epi, direction=f.get("direction", "none"), spatial_dims=f.get("spatial_dims", 0))
        alg_fields = {}
        for name in ("warps", "mma", "cluster", "scheduler", "split_k", "stages"):
            if name in f:
                alg_fields[name] = f[name]
            elif name in fixed:
                alg_fields[name] = tuple(fixed[name]) if isinstance(fixed[name], list) else fixed[name]
        extras = tuple((f"{backend}.{k}", v) for k, v in (f.get("extras") or {}).items())
        alg = Algorithm(tile=f["tile"], pipeline=f["pipeline"], extras=extras, **alg_fields)
        return KernelKey(sig, alg, backend, arch)
    except (TypeError, ValueError) as e:
        raise SpecError(f"{where}: {e}") from None


def _matches(key: KernelKey, pattern: dict) -> bool:
    d = key.to_dict()
    flat = {**d["signature"], **d["algorithm"], "backend": key.backend, "arch": key.arch}
    for name, want in pattern.items():
        if name == "dtype":
            if want != flat["dtype_a"]:
                return False
        elif name == "dtypes":
            if any(flat[f"dtype_{r}"] != v for r, v in want.items()):
                return False
        elif name == "epilogue":
            if any(flat["epilogue"].get(k) != v for k, v in want.items()):
                return False
        elif name == "extras":
            if any(flat["extras"].get(f"{key.backend}.{k}") != v for k, v in want.items()):
                return False
        elif flat.get(name) != want:
            return False
    return True
