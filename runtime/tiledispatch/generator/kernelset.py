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
        configs:                 # optional explicit list, each entry merged over the group: a field an entry
          - {tile: [64, 128, 128]}   # gives replaces the group's, so this group builds tile 64x128x128 only
    exclude:                     # optional: drop kernels matching every given field
      - {layout: rrr, tile: [48, 256, 256]}

Validation is strict: an unknown field, an unknown value, a value of the wrong type or an illegal combination
is a SpecError naming the file, the group and the kernel, and the rule it breaks.

Limits, so that a hostile or mistaken file fails at once instead of exhausting the machine: a set file is at
most 1 MiB, nests at most 32 levels, declares at most 100,000 YAML values with its aliases expanded and at most
1,000 exclude entries; the sets of one build may declare at most `max_kernels` (default 10,000) kernel
configurations before `exclude`, counted from the lengths of the lists before any key is built. A set is named
by a path ending in .yaml / .yml (the user's own file, anywhere) or by a plain name, looked up in preselected/
and kernel_specs/ only.
"""
from __future__ import annotations

import itertools
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

from ..errors import SpecError
from . import rules
from ..spec.key import Algorithm, Epilogue, KernelKey, Signature

SET_SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[3]
SEARCH_DIRS = (REPO_ROOT / "preselected", REPO_ROOT / "kernel_specs")

MAX_KERNELS = 10_000           # kernel configurations one build may declare (scons max_kernels=)
MAX_FILE_BYTES = 1 << 20       # size of one set file
MAX_YAML_DEPTH = 32            # nesting of sequences and mappings
MAX_YAML_NODES = 100_000       # values of one file, aliases expanded (an alias bomb stops here)
MAX_EXCLUDES = 1_000           # exclude entries of one file (each is matched against every kernel)

TOP_FIELDS = {"schema", "name", "description", "groups", "exclude"}
SELECT_FIELDS = {"backend", "arch"}
SIG_FIELDS = {"op", "direction", "spatial_dims", "dtype", "dtypes", "layout", "epilogue"}
TRIPLE_FIELDS = {"tile", "warps", "mma", "cluster"}
ALG_FIELDS = TRIPLE_FIELDS | {"pipeline", "scheduler", "split_k", "stages", "extras"}
KERNEL_FIELDS = SIG_FIELDS | ALG_FIELDS
GROUP_FIELDS = SELECT_FIELDS | KERNEL_FIELDS | {"configs"}
MAPPING_FIELDS = {"epilogue", "extras", "dtypes"}
EPILOGUE_FIELDS = {"activation", "bias", "residuals"}
DTYPES_FIELDS = {"a", "b", "c", "acc"}
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class KernelEntry:
    key: KernelKey
    origin: str          # "<file>: groups[i]" (and ".configs[j]")


@dataclass(frozen=True)
class _Plan:
    """A set file validated and counted for one backend and arch, before any key is built."""
    where: str
    configs: list         # (origin, fields) of every group entry for the target, the entry merged over its group
    excludes: list
    count: int            # kernel configurations before exclude


def find(spec: str) -> Path:
    """A kernel set by file path (*.yaml, *.yml), or by plain name in preselected/ or kernel_specs/."""
    if not isinstance(spec, str) or not spec:
        raise SpecError("empty kernel set name (kernels=<set|file.yaml>[,...])")
    path = Path(spec)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise SpecError(f"kernel set file {spec} does not exist or is not a regular file")
        return path
    if not _PLAIN_NAME.fullmatch(spec):
        raise SpecError(f"kernel set {spec!r} is not a plain name (letters, digits, '_', '-', '.'), so it is not "
                        "looked up in preselected/ or kernel_specs/; for a file elsewhere give its .yaml path")
    for d in SEARCH_DIRS:
        candidate = d / f"{spec}.yaml"
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for d in SEARCH_DIRS for p in d.glob("*.yaml"))
    raise SpecError(f"unknown kernel set {spec!r} (known: {', '.join(known)}; or give a .yaml path)")


def available_sets() -> dict[str, str]:
    """name -> description of every preselected and example set. A file that cannot be read as a set is listed
    with "broken: <file>: <why>" instead of its description, so one bad file breaks no other command."""
    out: dict[str, str] = {}
    for d in SEARCH_DIRS:
        for p in sorted(d.glob("*.yaml")):
            try:
                data = _read_yaml(p)
                if not isinstance(data, dict):
                    raise SpecError(f"{_display(p)}: expected a mapping with schema, name, groups")
                description = data.get("description", "")
                out.setdefault(p.stem, description if isinstance(description, str) else str(description))
            except SpecError as e:
                out.setdefault(p.stem, f"broken: {e}")
    return out


def load(specs, backend: str, arch: str, max_kernels: int = MAX_KERNELS) -> list[KernelEntry]:
    """Every kernel of the given sets for one backend and arch, without duplicates, in order. The sets together
    may declare at most max_kernels kernel configurations (counted before any key is built)."""
    if isinstance(specs, str):
        specs = specs.split(",") if specs else []
    if not specs:
        raise SpecError("no kernel set given (kernels=<set|file.yaml>[,...])")
    plans = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, str) or not spec.strip():
            raise SpecError(f"empty kernel set name: entry {i + 1} of {_short(specs)}")
        path = find(spec)
        plans.append((spec, path, _plan(path, backend, arch)))
    _check_bound([plan for _, _, plan in plans], max_kernels)
    seen: dict[KernelKey, KernelEntry] = {}
    for spec, path, plan in plans:
        entries = _expand(plan, backend, arch)
        if not entries:
            raise SpecError(f"kernel set {spec} has no kernels for backend {backend} arch {arch} "
                            f"(it declares: {', '.join(targets(path)) or 'nothing'})")
        for entry in entries:
            seen.setdefault(entry.key, entry)
    return list(seen.values())


def targets(path: Path) -> list[str]:
    """The backend/arch pairs a set file declares kernels for (malformed groups are left out)."""
    data = _read_yaml(path)
    groups = data.get("groups") if isinstance(data, dict) else None
    out = []
    for group in groups if isinstance(groups, list) else []:
        backend = group.get("backend") if isinstance(group, dict) else None
        if isinstance(backend, str) and backend in rules.all_rules():
            for a in _as_list(group.get("arch", list(rules.archs(backend)))):
                if isinstance(a, str) and f"{backend}/{a}" not in out:
                    out.append(f"{backend}/{a}")
    return out


def expand_file(path: Path, backend: str, arch: str, max_kernels: int = MAX_KERNELS) -> list[KernelEntry]:
    plan = _plan(Path(path), backend, arch)
    _check_bound([plan], max_kernels)
    return _expand(plan, backend, arch)


def _plan(path: Path, backend: str, arch: str) -> _Plan:
    data = _read_yaml(path)
    where = _display(path)
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a mapping with schema, name, groups")
    _no_unknown(where, data, TOP_FIELDS)
    if data.get("schema") != SET_SCHEMA_VERSION:
        raise SpecError(f"{where}: schema must be {SET_SCHEMA_VERSION}, got {_short(data.get('schema'))}")
    if data.get("name") != path.stem:
        raise SpecError(f"{where}: name {_short(data.get('name'))} must match the file name {path.stem!r}")
    groups = data.get("groups")
    if not isinstance(groups, list) or not groups:
        raise SpecError(f"{where}: groups must be a non-empty list")
    excludes = data.get("exclude") or []
    if not isinstance(excludes, list):
        raise SpecError(f"{where}: exclude must be a list of mappings")
    if len(excludes) > MAX_EXCLUDES:
        raise SpecError(f"{where}: exclude has {len(excludes)} entries, more than the {MAX_EXCLUDES} a set may have")
    for i, ex in enumerate(excludes):
        if not isinstance(ex, dict):
            raise SpecError(f"{where}: exclude[{i}] must be a mapping")
        _no_unknown(f"{where}: exclude[{i}]", ex, SELECT_FIELDS | KERNEL_FIELDS)
        for name in MAPPING_FIELDS & set(ex):
            if not isinstance(ex[name], dict):
                raise SpecError(f"{where}: exclude[{i}]: {name} must be a mapping, got {_short(ex[name])}")
    if backend not in rules.all_rules():
        raise SpecError(f"unknown backend {backend!r} (known: {', '.join(rules.all_rules())})")

    configs, count = [], 0
    for gi, group in enumerate(groups):
        gwhere = f"{where}: groups[{gi}]"
        if not isinstance(group, dict):
            raise SpecError(f"{gwhere}: expected a mapping")
        _no_unknown(gwhere, group, GROUP_FIELDS)
        group_backend = group.get("backend")
        if not isinstance(group_backend, str) or group_backend not in rules.all_rules():
            raise SpecError(f"{gwhere}: backend {_short(group_backend)} is not one of {', '.join(rules.all_rules())}")
        archs = _as_list(group.get("arch", list(rules.archs(group_backend))))
        for a in archs:
            if not isinstance(a, str) or a not in rules.archs(group_backend):
                raise SpecError(f"{gwhere}: arch {_short(a)} is not an arch of backend {group_backend} "
                                f"(known: {', '.join(rules.archs(group_backend))})")
        if group_backend != backend or arch not in archs:
            continue
        group_configs = group.get("configs", [{}])
        if not isinstance(group_configs, list) or not group_configs:
            raise SpecError(f"{gwhere}: configs must be a non-empty list of mappings")
        base = {k: v for k, v in group.items() if k not in GROUP_FIELDS - KERNEL_FIELDS}
        for ci, cfg in enumerate(group_configs):
            cwhere = gwhere + (f".configs[{ci}]" if "configs" in group else "")
            if not isinstance(cfg, dict):
                raise SpecError(f"{cwhere}: expected a mapping")
            _no_unknown(cwhere, cfg, KERNEL_FIELDS)
            fields = {**base, **cfg}
            count += math.prod(_field_values(n, v, cwhere)[0] for n, v in fields.items())
            configs.append((cwhere, fields))
    return _Plan(where, configs, excludes, count)


def _check_bound(plans: list[_Plan], max_kernels: int) -> None:
    if not isinstance(max_kernels, int) or isinstance(max_kernels, bool) or max_kernels < 1:
        raise SpecError(f"max_kernels must be a positive integer, got {max_kernels!r}")
    total = sum(p.count for p in plans)
    if total > max_kernels:
        counted = (f"{plans[0].where}: declares" if len(plans) == 1 else
                   " + ".join(f"{p.where} ({p.count})" for p in plans) + " declare")
        raise SpecError(f"{counted} {total} kernel configurations (before exclude), more than max_kernels="
                        f"{max_kernels}; split the set or raise the bound (scons max_kernels=N)")


def _expand(plan: _Plan, backend: str, arch: str) -> list[KernelEntry]:
    out = []
    for cwhere, fields in plan.configs:
        for combo in _product(fields, cwhere):
            key = _make_key(combo, backend, arch, cwhere)
            flat = _flat(key) if plan.excludes else {}
            if any(_matches(flat, backend, ex) for ex in plan.excludes):
                continue
            try:
                violations = rules.check(key)
            except RuntimeError as e:  # a rule that cannot judge this key: a bug in the rules, named
                raise SpecError(f"{cwhere}: kernel {key.name}: {_one_line(e)}") from None
            if violations:
                raise SpecError(f"{cwhere}: kernel {key.name} is illegal: " + "; ".join(map(str, violations)))
            out.append(KernelEntry(key, cwhere))
    return out


# ---- reading YAML within bounds ---------------------------------------------------------------------------

class _YamlLimit(yaml.YAMLError):
    """A set file past one of the parsing limits."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses nesting deeper than MAX_YAML_DEPTH, an alias of a node that contains it, and more
    than MAX_YAML_NODES values with aliases expanded, while composing: before anything is built from them."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._sizes: dict[int, int] = {}   # id(node) -> values it stands for, aliases expanded

    def compose_node(self, parent, index):
        alias = self.check_event(yaml.AliasEvent)
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _YamlLimit(f"nested deeper than {MAX_YAML_DEPTH} levels")
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if id(node) in self._sizes:   # an alias of a finished node: counted again where it is used
            return node
        if alias:                     # an alias of a node still being composed: it would contain itself
            raise _YamlLimit("a recursive alias (a node that contains itself)")
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            children = []
        size = 1 + sum(self._sizes[id(c)] for c in children)
        if size > MAX_YAML_NODES:
            raise _YamlLimit(f"more than {MAX_YAML_NODES} values with aliases expanded")
        self._sizes[id(node)] = size
        return node


def _read_yaml(path: Path) -> Any:
    """A set file's YAML, within the limits; SpecError naming the file otherwise."""
    where = _display(path)
    try:  # non-blocking, so that a FIFO in a file's place is refused instead of waited on
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise SpecError(f"{where}: cannot be read: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise SpecError(f"{where}: not a regular file")
        try:
            text = f.read(MAX_FILE_BYTES + 1)
        except OSError as e:
            raise SpecError(f"{where}: cannot be read: {e.strerror}") from None
    if len(text) > MAX_FILE_BYTES:
        raise SpecError(f"{where}: larger than the {MAX_FILE_BYTES >> 20} MiB a kernel set file may have")
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader
    except _YamlLimit as e:
        raise SpecError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{where}: not valid YAML: {_yaml_problem(e)}") from None
    except RecursionError:
        raise SpecError(f"{where}: nested too deeply") from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error on one line: where and what."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is not None and problem:
        context = getattr(e, "context", None)
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")
    return " ".join(str(e).split())


# ---- fields -------------------------------------------------------------------------------------------------

def _display(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except (ValueError, OSError):
        return str(path)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _no_unknown(where: str, d: dict, allowed: set) -> None:
    unknown = sorted((k for k in d if k not in allowed), key=str)
    if unknown:
        raise SpecError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(str, unknown))} "
                        f"(allowed: {', '.join(sorted(allowed))})")


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _field_values(name: str, value: Any, where: str) -> tuple[int, Iterable]:
    """How many alternatives one field stands for, and an iterable over them. A mapping field (epilogue, extras,
    dtypes) stands for the product of its own list fields, counted without building it."""
    if name in TRIPLE_FIELDS:
        if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            return len(value), [tuple(v) for v in value]
        if isinstance(value, list):
            return 1, [tuple(value)]
        raise SpecError(f"{where}: {name} must be [m, n, k] or a list of them, got {_short(value)}")
    if name in MAPPING_FIELDS:
        alternatives = _as_list(value)
        if not alternatives:
            raise SpecError(f"{where}: {name} is an empty list")
        count = 0
        for alt in alternatives:
            if not isinstance(alt, dict):
                raise SpecError(f"{where}: {name} must be a mapping or a list of mappings, got {_short(alt)}")
            if name == "epilogue":
                _no_unknown(f"{where}: epilogue", alt, EPILOGUE_FIELDS)
            if name == "dtypes":
                _no_unknown(f"{where}: dtypes", alt, DTYPES_FIELDS)
            for k, v in alt.items():
                if v == []:
                    raise SpecError(f"{where}: {name}.{k} is an empty list")
            count += math.prod(len(_as_list(v)) for v in alt.values())

        def combinations():
            for alt in alternatives:
                keys = sorted(alt, key=str)
                for combo in itertools.product(*(_as_list(alt[k]) for k in keys)):
                    yield dict(zip(keys, combo))
        return count, combinations()
    values = _as_list(value)
    if not values:
        raise SpecError(f"{where}: {name} is an empty list")
    return len(values), values


def _product(fields: dict, where: str):
    names = sorted(fields)
    for combo in itertools.product(*(_field_values(n, fields[n], where)[1] for n in names)):
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
        raise SpecError(f"{where}: {_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def _flat(key: KernelKey) -> dict:
    d = key.to_dict()
    return {**d["signature"], **d["algorithm"], "backend": key.backend, "arch": key.arch}


def _matches(flat: dict, backend: str, pattern: dict) -> bool:
    for name, want in pattern.items():
        if name == "dtype":
            if want != flat["dtype_a"]:
                return False
        elif name == "dtypes":
            if any(flat.get(f"dtype_{r}") != v for r, v in want.items()):
                return False
        elif name == "epilogue":
            if any(flat["epilogue"].get(k) != v for k, v in want.items()):
                return False
        elif name == "extras":
            if any(flat["extras"].get(f"{backend}.{k}") != v for k, v in want.items()):
                return False
        elif flat.get(name) != want:
            return False
    return True
