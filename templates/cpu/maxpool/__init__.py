"""cpu max pooling (pipeline window): OpenMP threads take tile m output pixels at a time; each pixel's channels are
the vector lanes, the window's taps inside the input the loop. tile [pixels per task, 1, 1], mma [1, 1, 1]."""
from .. import common


def claims(key) -> bool:
    return key.signature.op == "maxpool"


def templates(key) -> list[str]:
    return ["maxpool.cpp.j2"]


context = common.context
