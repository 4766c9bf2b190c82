"""cpu LayerNorm over rows (pipeline rows): OpenMP threads take tile m rows at a time; each row is converted once
into a per-thread buffer of the accumulator type and read from there three times (mean, centered variance, the
normalized store). tile [rows per task, 1, 1], mma [1, 1, 1]."""
from .. import common


def claims(key) -> bool:
    return key.signature.op == "layernorm"


def templates(key) -> list[str]:
    return ["layernorm.cpp.j2"]


context = common.context
