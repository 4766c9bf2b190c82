"""cpu LayerNorm over rows (pipeline rows): OpenMP threads take tile m rows at a time; each row is read three times
(mean, centered variance, the normalized store), its statistics in the accumulator type. tile [rows per task, 1, 1],
mma [1, 1, 1]."""
from .. import common


def claims(key) -> bool:
    return key.signature.op == "layernorm"


def templates(key) -> list[str]:
    return ["layernorm.cpp.j2"]


context = common.context
