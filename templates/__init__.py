"""Kernel families, one folder per backend and per family: the package `tiledispatch.families`.

templates/<backend>/__init__.py registers the backend (its facts and driver, tiledispatch/backends.py); its
rules.yaml holds the backend-wide legality rules (read by the generator only) and its _*.j2 files the partials
its families share. Each subfolder with an __init__.py is a kernel family: that module (pure Python, no Jinja,
no YAML) says which keys are its own, which templates render them and with what values, and how the ranker
models them; next to it lie its templates and its rules fragment (rules.yaml).
"""
