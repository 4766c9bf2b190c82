"""The spec layer: kernel keys, dtypes, legality rules and problems. No Jinja, no SCons."""
