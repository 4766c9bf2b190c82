"""Where the runtime keeps what it writes for later processes: extracted packs, the native torch fast path."""
from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(variable: str, leaf: str) -> Path:
    """$variable, else $XDG_CACHE_HOME/tiledispatch/<leaf>, else ~/.cache/tiledispatch/<leaf>."""
    value = os.environ.get(variable)
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiledispatch" / leaf
