"""The one kernel key.

A KernelKey is frozen and hashable, made of a Signature (what is computed: op, conv direction and
rank, the dtype of every operand and of the accumulator, layouts, epilogue) and an Algorithm (how:
tile, warps, instruction shape, pipeline, scheduler, split-K, cluster, stages, plus backend fields
namespaced as "<backend>.<field>"), and the backend and arch it is built for.

Every name (file, registry id, manifest entry) comes from `kernel_name(key)`, and
`parse_kernel_name(name)` gives the key back. `key.to_json()` / `KernelKey.from_json()` is the
serialized form, with a schema version. Enum values are checked on construction: an unknown value
is a ValueError naming the field, never a silent default.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..reference import ACTIVATIONS as _ACTIVATION_REFERENCES
from .dtypes import DTYPES

KEY_SCHEMA_VERSION = 1

OPS = ("gemm", "conv", "layernorm", "maxpool")
DIRECTIONS = ("none", "fwd", "bwd_data", "bwd_weight")  # "none" for every op but conv
# the activations are those the float64 reference defines (reference.ACTIVATIONS): a new one is its reference
# there plus its code in each backend's epilogue template
ACTIVATIONS = tuple(_ACTIVATION_REFERENCES)
# GEMM layouts: row (r) / column (c) major for A, B and C, in that order.
GEMM_LAYOUTS = tuple(a + b + c for a in "rc" for b in "rc" for c in "rc")
# Conv layouts: channels-last with an explicit group axis; the rank comes from spatial_dims
# (input NWGC / NHWGC / NDHWGC, weight GKXC / GKYXC / GKZYXC, output NWGK / NHWGK / NDHWGK).
CONV_LAYOUTS = ("nhwgc",)
# LayerNorm layout: rows of the normalized (last, unit-stride) dim; A is x, B the affine weight and bias, C y.
LAYERNORM_LAYOUTS = ("rows",)
# Max pooling layout: channels-last maps, 1D / 2D / 3D problems as 3D ones [N, D, H, W, C] (unit dims added).
POOL_LAYOUTS = ("ndhwc",)
_PLAIN_LAYOUTS = {"gemm": GEMM_LAYOUTS, "layernorm": LAYERNORM_LAYOUTS, "maxpool": POOL_LAYOUTS}

_NAME_TOKEN = re.compile(r"^[a-z0-9]+$")


def _check_enum(field_name: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{field_name}: unknown value {value!r} (allowed: {', '.join(map(str, allowed))})")


def _check_triple(field_name: str, value: Any) -> tuple[int, int, int]:
    if (not isinstance(value, (tuple, list)) or len(value) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"{field_name}: expected three positive integers [m, n, k], got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class Epilogue:
    """D = activation(alpha * acc + beta * C + bias[n] + sum(residual_i)).

    alpha, beta and the clamp bounds are run-time scalars; what is fixed at compile time is
    which activation, whether a per-column bias vector is read, and how many residual tensors.
    """
    activation: str = "identity"
    bias: bool = False
    residuals: int = 0

    def __post_init__(self):
        _check_enum("epilogue.activation", self.activation, ACTIVATIONS)
        if not isinstance(self.bias, bool):
            raise ValueError(f"epilogue.bias: expected true or false, got {self.bias!r}")
        if not isinstance(self.residuals, int) or isinstance(self.residuals, bool) or not 0 <= self.residuals <= 4:
            raise ValueError(f"epilogue.residuals: expected an integer 0..4, got {self.residuals!r}")


@dataclass(frozen=True)
class Signature:
    """What the kernel computes. For conv, A is the input x, B the weight w, C the output y."""
    op: str
    dtype_a: str
    dtype_b: str
    dtype_c: str
    dtype_acc: str
    layout: str
    epilogue: Epilogue = Epilogue()
    direction: str = "none"
    spatial_dims: int = 0

    def __post_init__(self):
        _check_enum("op", self.op, OPS)
        for name in ("dtype_a", "dtype_b", "dtype_c", "dtype_acc"):
            _check_enum(name, getattr(self, name), tuple(DTYPES))
        if not isinstance(self.epilogue, Epilogue):
            raise ValueError(f"epilogue: expected an Epilogue, got {self.epilogue!r}")
        if not isinstance(self.spatial_dims, int) or isinstance(self.spatial_dims, bool):
            raise ValueError(f"spatial_dims: expected an integer, got {self.spatial_dims!r}")
        if self.op in _PLAIN_LAYOUTS:
            _check_enum("layout", self.layout, _PLAIN_LAYOUTS[self.op])
            if self.direction != "none" or self.spatial_dims != 0:
                raise ValueError(f"{self.op} keys take no direction or spatial_dims")
            if self.op != "gemm" and self.epilogue != Epilogue():
                raise ValueError(f"{self.op} keys take no epilogue")
        else:
            _check_enum("layout", self.layout, CONV_LAYOUTS)
            _check_enum("direction", self.direction, DIRECTIONS[1:])
            _check_enum("spatial_dims", self.spatial_dims, (1, 2, 3))

    @property
    def layout_a(self) -> str:
        return self.layout[0]

    @property
    def layout_b(self) -> str:
        return self.layout[1]

    @property
    def layout_c(self) -> str:
        return self.layout[2]


@dataclass(frozen=True)
class Algorithm:
    """How the kernel computes it.

    tile:      block tile [m, n, k] in elements (cpu: the cache block).
    warps:     warps (NVIDIA) or waves (AMD) per block along m, n, k; cpu: [1, 1, 1].
    mma:       shape of one matrix instruction (cpu: the register micro-tile).
    pipeline:  main-loop algorithm (backend vocabulary, see rules.yaml).
    scheduler: instruction or tile scheduler (backend vocabulary).
    split_k:   number of K slices.  cluster: thread-block cluster (sm90).  stages: 0 = auto.
    extras:    backend-specific fields, sorted ("<backend>.<field>", value) pairs.
    """
    tile: tuple[int, int, int]
    pipeline: str
    warps: tuple[int, int, int] = (1, 1, 1)
    mma: tuple[int, int, int] = (1, 1, 1)
    scheduler: str = "default"
    split_k: int = 1
    cluster: tuple[int, int, int] = (1, 1, 1)
    stages: int = 0
    extras: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self):
        for name in ("tile", "warps", "mma", "cluster"):
            object.__setattr__(self, name, _check_triple(name, getattr(self, name)))
        for name in ("pipeline", "scheduler"):
            value = getattr(self, name)
            if not isinstance(value, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", value):
                raise ValueError(f"{name}: expected a lower-case identifier, got {value!r}")
        for name, low in (("split_k", 1), ("stages", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        extras = dict(self.extras)
        for name, value in extras.items():
            if not re.fullmatch(r"[a-z_]+\.[a-z][a-z0-9_]*", name):
                raise ValueError(f"extras: field names are '<backend>.<field>', got {name!r}")
            if not isinstance(value, (bool, int, str)):
                raise ValueError(f"extras: {name} must be a bool, int or str, got {value!r}")
            # values become part of the kernel's name: non-negative integers and lower-case identifiers only
            if (isinstance(value, int) and not isinstance(value, bool) and value < 0) or \
                    (isinstance(value, str) and not re.fullmatch(r"[a-z][a-z0-9_]*", value)):
                raise ValueError(f"extras: {name} must be a non-negative integer or a lower-case identifier, "
                                 f"got {value!r}")
        object.__setattr__(self, "extras", tuple(sorted(extras.items())))
        # looked up per kernel and problem by the cost models (selection.cost_terms): not rebuilt per lookup; not a
        # field, so equality, hashing and the name stay the extras tuple's
        object.__setattr__(self, "_extras_by_name", extras)

    def extra(self, name: str, default: Any = None) -> Any:
        return self._extras_by_name.get(name, default)


@dataclass(frozen=True)
class KernelKey:
    signature: Signature
    algorithm: Algorithm
    backend: str
    arch: str

    def __post_init__(self):
        _check_enum("backend", self.backend, _backend_names())
        if not isinstance(self.arch, str) or not _NAME_TOKEN.match(self.arch):
            raise ValueError(f"arch: expected a lower-case alphanumeric arch name, got {self.arch!r}")
        for name, _ in self.algorithm.extras:
            if name.split(".")[0] != self.backend:
                raise ValueError(f"extras: {name} belongs to another backend than {self.backend}")
        # an extra spelled out at its default is the same kernel as the extra omitted: one key, one name
        from .. import backends

        declared = backends.get(self.backend).extras if self.backend in backends.names() else {}
        kept = tuple((n, v) for n, v in self.algorithm.extras
                     if "default" not in declared.get(n.split(".", 1)[1], {})
                     or declared[n.split(".", 1)[1]]["default"] != v)
        if kept != self.algorithm.extras:
            object.__setattr__(self, "algorithm", replace(self.algorithm, extras=kept))

    @property
    def name(self) -> str:
        return kernel_name(self)

    def to_dict(self) -> dict:
        sig, alg = self.signature, self.algorithm
        return {
            "schema": KEY_SCHEMA_VERSION,
            "backend": self.backend,
            "arch": self.arch,
            "signature": {
                "op": sig.op, "direction": sig.direction, "spatial_dims": sig.spatial_dims,
                "dtype_a": sig.dtype_a, "dtype_b": sig.dtype_b, "dtype_c": sig.dtype_c,
                "dtype_acc": sig.dtype_acc, "layout": sig.layout,
                "epilogue": {"activation": sig.epilogue.activation, "bias": sig.epilogue.bias,
                             "residuals": sig.epilogue.residuals},
            },
            "algorithm": {
                "tile": list(alg.tile), "warps": list(alg.warps), "mma": list(alg.mma),
                "pipeline": alg.pipeline, "scheduler": alg.scheduler, "split_k": alg.split_k,
                "cluster": list(alg.cluster), "stages": alg.stages,
                "extras": {k: v for k, v in alg.extras},
            },
        }

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no spaces, so equal keys give equal bytes."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "KernelKey":
        if not isinstance(d, dict):
            raise ValueError(f"kernel key: expected an object, got {type(d).__name__}")
        if d.get("schema") != KEY_SCHEMA_VERSION:
            raise ValueError(f"kernel key: schema {d.get('schema')!r} is not the supported {KEY_SCHEMA_VERSION}")
        _expect_fields("kernel key", d, {"schema", "backend", "arch", "signature", "algorithm"})
        sig = dict(d["signature"])
        _expect_fields("signature", sig, {f.name for f in fields(Signature)})
        epi = sig.pop("epilogue")
        _expect_fields("epilogue", epi, {f.name for f in fields(Epilogue)})
        alg = dict(d["algorithm"])
        _expect_fields("algorithm", alg, {f.name for f in fields(Algorithm)})
        for name in ("tile", "warps", "mma", "cluster"):
            alg[name] = tuple(alg[name])
        alg["extras"] = tuple(sorted(alg["extras"].items()))
        return cls(signature=Signature(epilogue=Epilogue(**epi), **sig), algorithm=Algorithm(**alg),
                   backend=d["backend"], arch=d["arch"])

    @classmethod
    def from_json(cls, text: str) -> "KernelKey":
        return cls.from_dict(json.loads(text))

    def replace(self, **changes) -> "KernelKey":
        return replace(self, **changes)


def _expect_fields(where: str, d: dict, expected: set) -> None:
    missing, unknown = expected - set(d), set(d) - expected
    if missing or unknown:
        raise ValueError(f"{where}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")


# ---------------------------------------------------------------------------------------------
# Names. Tokens are separated by "_" and use only [a-z0-9], so a name is a file name, a C
# identifier and a registry id at once. Enum values that contain "_" are written without it;
# the tables below map them back, and import fails if two values would collide.

def _squeeze_table(values) -> dict[str, str]:
    table = {v.replace("_", ""): v for v in values}
    assert len(table) == len(tuple(values)), f"enum values collide without underscores: {values}"
    return table


_ACT = _squeeze_table(ACTIVATIONS)
_DIR = {"fwd": "fwd", "bwdd": "bwd_data", "bwdw": "bwd_weight"}
_DIR_INV = {v: k for k, v in _DIR.items()}


def _backend_names() -> list[str]:
    """The registered backends (one folder each under templates/: backends.py), the key's backend vocabulary."""
    from .. import backends

    return backends.names()


def _triple(t) -> str:
    return "x".join(map(str, t))


def _squeeze(value: str) -> str:
    return value.replace("_", "")


def _extra_token(name: str, value: Any) -> str:
    field_name = _squeeze(name.split(".", 1)[1])
    if isinstance(value, bool):
        return f"{field_name}{int(value)}"
    return f"{field_name}{_squeeze(str(value))}"


def kernel_name(key: KernelKey) -> str:
    sig, alg = key.signature, key.algorithm
    op = sig.op if sig.op != "conv" else f"conv{sig.spatial_dims}d{_DIR_INV[sig.direction]}"
    epi = _squeeze(sig.epilogue.activation)
    epi += "bias" if sig.epilogue.bias else ""
    epi += f"res{sig.epilogue.residuals}" if sig.epilogue.residuals else ""
    tokens = [
        op, "x".join((sig.dtype_a, sig.dtype_b, sig.dtype_c, sig.dtype_acc)), sig.layout, epi,
        _squeeze(key.backend), key.arch,
        "t" + _triple(alg.tile), "w" + _triple(alg.warps), "i" + _triple(alg.mma),
        "p" + _squeeze(alg.pipeline), "s" + _squeeze(alg.scheduler), f"k{alg.split_k}",
        "c" + _triple(alg.cluster), f"st{alg.stages}",
    ]
    tokens += ["x" + _extra_token(n, v) for n, v in alg.extras]
    name = "_".join(tokens)
    assert all(_NAME_TOKEN.match(t) for t in tokens), name
    return name


def parse_kernel_name(name: str, vocabulary=None) -> KernelKey:
    """The key a name was made from.

    Pipeline, scheduler and extra names lose their underscores in a name; `vocabulary` (default:
    the rules table) gives the spellings back. Raises ValueError for anything that is not a name
    `kernel_name` could have produced.
    """
    from .. import backends  # the vocabulary of backend-specific values is the backends' facts

    vocab = vocabulary or backends.vocabulary()
    tokens = name.split("_")
    if len(tokens) < 14:
        raise ValueError(f"not a kernel name (too few fields): {name!r}")
    op_tok, dtypes_tok, layout, epi_tok, backend_tok, arch = tokens[:6]
    try:
        if op_tok in _PLAIN_LAYOUTS:
            op, direction, dims = op_tok, "none", 0
        else:
            m = re.fullmatch(r"conv([123])d(fwd|bwdd|bwdw)", op_tok)
            if not m:
                raise ValueError(f"bad op field {op_tok!r}")
            op, direction, dims = "conv", _DIR[m.group(2)], int(m.group(1))
        dts = dtypes_tok.split("x")
        if len(dts) != 4:
            raise ValueError(f"bad dtype field {dtypes_tok!r}")
        m = re.fullmatch(r"([a-z]+?)(bias)?(?:res(\d))?", epi_tok)
        if not m or m.group(1) not in _ACT:
            raise ValueError(f"bad epilogue field {epi_tok!r}")
        epilogue = Epilogue(_ACT[m.group(1)], bool(m.group(2)), int(m.group(3) or 0))
        backend = _squeeze_table(_backend_names())[backend_tok]

        def triple(tok, prefix):
            if not tok.startswith(prefix):
                raise ValueError(f"expected a {prefix!r} field, got {tok!r}")
            return tuple(int(v) for v in tok[len(prefix):].split("x"))

        def word(tok, prefix, known):
            if not tok.startswith(prefix) or tok[len(prefix):] not in known:
                raise ValueError(f"unknown {prefix!r} field {tok!r}")
            return known[tok[len(prefix):]]

        alg_tokens = tokens[6:]
        tile, warps, mma = (triple(alg_tokens[i], p) for i, p in enumerate("twi"))
        pipeline = word(alg_tokens[3], "p", _squeeze_table(vocab["pipeline"]))
        scheduler = word(alg_tokens[4], "s", _squeeze_table(vocab["scheduler"]))
        split_k = int(alg_tokens[5][1:]) if alg_tokens[5].startswith("k") else None
        cluster = triple(alg_tokens[6], "c")
        if split_k is None or not alg_tokens[7].startswith("st"):
            raise ValueError("bad split_k or stages field")
        stages = int(alg_tokens[7][2:])
        extras = []
        declared = vocab["extras"].get(backend, {})
        for tok in alg_tokens[8:]:
            extras.append(_parse_extra(tok, backend, declared))
    except (KeyError, ValueError, IndexError) as e:
        raise ValueError(f"not a kernel name: {name!r}: {e}") from None
    key = KernelKey(
        signature=Signature(op, dts[0], dts[1], dts[2], dts[3], layout, epilogue, direction, dims),
        algorithm=Algorithm(tile, pipeline, warps, mma, scheduler, split_k, cluster, stages, tuple(extras)),
        backend=backend, arch=arch)
    if kernel_name(key) != name:
        raise ValueError(f"not a canonical kernel name: {name!r} (canonical: {kernel_name(key)!r})")
    return key


def _parse_extra(tok: str, backend: str, declared: dict) -> tuple[str, Any]:
    """declared: field name -> spec with "type" (bool|int|enum) and, for enums, "values"."""
    if not tok.startswith("x"):
        raise ValueError(f"unexpected field {tok!r}")
    body = tok[1:]
    for fname, spec in declared.items():
        prefix = _squeeze(fname)
        if not body.startswith(prefix):
            continue
        raw = body[len(prefix):]
        kind = spec["type"]
        if kind == "bool" and raw in ("0", "1"):
            return f"{backend}.{fname}", raw == "1"
        if kind == "int" and raw.isdigit():
            return f"{backend}.{fname}", int(raw)
        if kind == "enum":
            table = _squeeze_table(spec["values"])
            if raw in table:
                return f"{backend}.{fname}", table[raw]
    raise ValueError(f"unknown extra field {tok!r} for backend {backend}")
