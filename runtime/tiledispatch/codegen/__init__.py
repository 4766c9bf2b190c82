"""Render kernel sources from keys: pure functions over strings, no SCons."""
from .render import render, source_name, template_files  # noqa: F401
