"""Legality rules, read from each backend folder's rules.yaml (templates/<backend>/rules.yaml) and the
rules.yaml of its family folders, on top of the backend's facts (templates/<backend>/__init__.py: archs with their
properties, pipeline / scheduler vocabulary, namespaced extra fields, tolerances).

A rules file lists a backend's ops, legal dtype combinations and layouts per op, the fields it fixes, and
constraints written as Python expressions over the key's flattened fields. This module only evaluates that data:
it names no backend.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .. import backends
from ..spec.dtypes import dtype as _dtype
from ..spec.key import KernelKey

RULES_FILE = "rules.yaml"
RULES_SCHEMA_VERSION = 1
# what the rules read of the backend's facts (backends.Backend), under the names the rules data always had
FACTS = ("device", "auto_priority", "archs", "pipeline", "scheduler", "extras", "tolerance", "selection")


@dataclass(frozen=True)
class Violation:
    rule: str
    message: str

    def __str__(self) -> str:
        return f"rule {self.rule}: {self.message}"


def rules_files(backend: str) -> list[Path]:
    """The backend's rules file and its families' (in family order), the ones that exist."""
    b = backends.get(backend)
    return [p for p in (b.path / RULES_FILE, *(f.path / RULES_FILE for f in b.families)) if p.is_file()]


def _load(backend: str) -> dict:
    """The backend's facts and its rules data: the backend's rules file, then each family's `rules` appended."""
    data: dict = {}
    for path in rules_files(backend):
        part = yaml.safe_load(path.read_text()) or {}
        if part.get("schema") != RULES_SCHEMA_VERSION or part.get("backend") != backend:
            raise ValueError(f"{path}: rules schema {part.get('schema')!r} of backend {part.get('backend')!r}, "
                             f"expected schema {RULES_SCHEMA_VERSION} of backend {backend}")
        clash = sorted((set(part) & set(FACTS)) | (set(part) & set(data) - {"schema", "backend", "rules"}))
        if clash:
            raise ValueError(f"{path}: {', '.join(clash)} defined twice (facts belong to the backend's __init__.py)")
        rules = data.get("rules", []) + (part.pop("rules", None) or [])
        data.update(part, rules=rules)
    b = backends.get(backend)
    data.update(device=b.device, auto_priority=b.auto_priority, archs=dict(b.archs), pipeline=list(b.pipeline),
                scheduler=list(b.scheduler), extras=dict(b.extras), tolerance=dict(b.tolerance),
                selection=dict(b.selection))
    return data


@functools.lru_cache(maxsize=None)
def all_rules() -> dict[str, dict]:
    """backend name -> its rules (with the facts they read), for every backend."""
    return {name: _load(name) for name in backends.names()}


def backend_rules(backend: str) -> dict:
    rules = all_rules()
    if backend not in rules:
        raise ValueError(f"unknown backend {backend!r} (known: {', '.join(rules)})")
    return rules[backend]


def archs(backend: str) -> dict[str, dict]:
    return backend_rules(backend)["archs"]


def namespace(key: KernelKey) -> dict[str, Any]:
    """The names a rule expression can use."""
    sig, alg = key.signature, key.algorithm
    ns: dict[str, Any] = {
        "op": sig.op, "direction": sig.direction, "spatial_dims": sig.spatial_dims,
        "dtype_a": sig.dtype_a, "dtype_b": sig.dtype_b, "dtype_c": sig.dtype_c, "dtype_acc": sig.dtype_acc,
        "layout": sig.layout, "activation": sig.epilogue.activation, "bias": sig.epilogue.bias,
        "residuals": sig.epilogue.residuals,
        "pipeline": alg.pipeline, "scheduler": alg.scheduler, "split_k": alg.split_k, "stages": alg.stages,
        "tile": list(alg.tile), "warps": list(alg.warps), "mma": list(alg.mma), "cluster": list(alg.cluster),
        "arch": key.arch, "arch_info": archs(key.backend).get(key.arch, {}),
        # the resource limits a family computes (its module's smem_bytes(key)), called by the rules that need them
        "smem_bytes": lambda: backends.family_of(key).module.smem_bytes(key),
        "size": lambda name: _dtype(name).itemsize,
        "all": all, "any": any, "min": min, "max": max, "len": len,
    }
    for name in ("tile", "warps", "mma", "cluster"):
        for axis, value in zip("mnk", getattr(alg, name)):
            ns[f"{name}_{axis}"] = value
    extras_spec = backend_rules(key.backend).get("extras") or {}
    for fname, spec in extras_spec.items():
        ns[fname] = alg.extra(f"{key.backend}.{fname}", spec.get("default"))
    return ns


@functools.lru_cache(maxsize=None)
def _compiled(expr: str):
    return compile(expr, "<rule>", "eval")


def _evaluate(expr: str, ns: dict, rule_id: str) -> Any:
    try:
        return eval(_compiled(expr), {"__builtins__": {}}, ns)  # noqa: S307 - our own data files
    except Exception as e:  # a broken rule is a bug in the rules file, say which
        raise RuntimeError(f"rule {rule_id}: cannot evaluate {expr!r}: {e}") from e


def _format(message: str, ns: dict, rule_id: str) -> str:
    return re.sub(r"\{([^{}]+)\}", lambda m: str(_evaluate(m.group(1), ns, rule_id)), message)


def check(key: KernelKey) -> list[Violation]:
    """Every rule the key breaks; empty when the key is legal for its backend and arch."""
    data = backend_rules(key.backend)
    sig, alg = key.signature, key.algorithm
    b = key.backend
    out: list[Violation] = []

    def bad(rule, message):
        out.append(Violation(f"{b}.{rule}", message))

    if key.arch not in data["archs"]:
        bad("arch", f"arch {key.arch!r} is not one of {', '.join(data['archs'])}")
        return out
    if sig.op not in data["ops"]:
        return [Violation(f"{b}.op", f"op {sig.op!r} is not supported (supported: {', '.join(data['ops'])})")]
    combo = [sig.dtype_a, sig.dtype_b, sig.dtype_c, sig.dtype_acc]
    legal = data["dtypes"][sig.op]
    if combo not in legal:
        bad("dtypes", f"dtypes a/b/c/acc {'/'.join(combo)} are not a legal {sig.op} combination "
                      f"(legal: {'; '.join('/'.join(c) for c in legal)})")
    if sig.layout not in data["layouts"][sig.op]:
        bad("layout", f"layout {sig.layout!r} is not supported for {sig.op} "
                      f"(supported: {', '.join(data['layouts'][sig.op])})")
    for name in ("pipeline", "scheduler"):
        if getattr(alg, name) not in data[name]:
            bad(name, f"{name} {getattr(alg, name)!r} is not one of {', '.join(data[name])}")
    for name, value in (data.get("fixed") or {}).items():
        actual = getattr(alg, name)
        if (list(actual) if isinstance(actual, tuple) else actual) != value:
            bad(f"fixed.{name}", f"{b} has one legal {name}, {value}; got {actual}")
    extras_spec = data.get("extras") or {}
    for fullname, value in alg.extras:
        fname = fullname.split(".", 1)[1]
        spec = extras_spec.get(fname)
        if spec is None:
            bad("extras", f"unknown field {fullname!r} (known: {', '.join(extras_spec) or 'none'})")
        elif not _extra_value_ok(spec, value):
            bad(f"extras.{fname}", f"{fullname} = {value!r} is not a legal value ({_describe(spec)})")
    if out:  # the expressions below assume the basics hold
        return out
    ns = namespace(key)
    for rule in data.get("rules") or []:
        if "when" in rule and not _evaluate(rule["when"], ns, rule["id"]):
            continue
        if not _evaluate(rule["require"], ns, rule["id"]):
            out.append(Violation(rule["id"], _format(rule["message"], ns, rule["id"])))
    return out


def _extra_value_ok(spec: dict, value: Any) -> bool:
    kind = spec["type"]
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return value in spec["values"]


def _describe(spec: dict) -> str:
    return "one of " + ", ".join(map(str, spec["values"])) if spec["type"] == "enum" else spec["type"]


def default_acc_combo(backend: str, op: str, dtype_name: str) -> list[str]:
    """The [a, b, c, acc] combination meant by the shorthand `dtype: X`: the one legal combination
    whose a and b are X. Ambiguity (e.g. fp8 with fp16 or bf16 output) is an error, not a choice."""
    legal = backend_rules(backend)["dtypes"].get(op, [])
    matches = [c for c in legal if c[0] == dtype_name and c[1] == dtype_name]
    if len(matches) == 1:
        return list(matches[0])
    if not matches:
        raise ValueError(f"dtype {dtype_name!r} has no legal {op} combination on backend {backend}")
    raise ValueError(f"dtype {dtype_name!r} is ambiguous on backend {backend} ({'; '.join('/'.join(m) for m in matches)}): "
                     "give `dtypes: {a, b, c, acc}`")
