"""Render one kernel key into one source file.

Templates live in templates/<backend>/ and are dumb (loops and conditionals only); every value they
need comes from the backend's context(key) plus the fields common to all backends below. The backend
declares which templates a key uses; rendering any undeclared one fails, so the build's dependency
list (template_files) cannot silently miss a template.
"""
from __future__ import annotations

from pathlib import Path

import jinja2

from .. import backends
from ..spec import rules
from ..spec.key import KernelKey

TEMPLATES_ROOT = Path(__file__).resolve().parents[3] / "templates"


class _RecordingLoader(jinja2.FileSystemLoader):
    def __init__(self, root: Path):
        super().__init__(str(root))
        self.loaded: set[str] = set()

    def get_source(self, environment, template):
        self.loaded.add(template)
        return super().get_source(environment, template)


def source_name(key: KernelKey) -> str:
    return key.name + backends.get(key.backend).SOURCE_SUFFIX


def template_files(key: KernelKey, root: Path = TEMPLATES_ROOT) -> list[Path]:
    """The template files the key's source is rendered from (its build dependencies)."""
    return [root / key.backend / name for name in backends.get(key.backend).templates(key)]


def render(key: KernelKey, root: Path = TEMPLATES_ROOT) -> str:
    violations = rules.check(key)
    if violations:
        raise ValueError(f"{key.name}: illegal configuration: " + "; ".join(map(str, violations)))
    backend = backends.get(key.backend)
    declared = backend.templates(key)
    loader = _RecordingLoader(root / key.backend)
    env = jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, autoescape=False)
    sig, alg = key.signature, key.algorithm
    ctx = {
        "name": key.name, "key_json": key.to_json(), "sig": sig, "alg": alg, "epi": sig.epilogue,
        "key": key, "template": f"templates/{key.backend}/{declared[0]}",
    }
    ctx.update(backend.context(key))
    text = env.get_template(declared[0]).render(ctx)
    undeclared = loader.loaded - set(declared)
    if undeclared:
        raise RuntimeError(f"{key.backend} backend rendered undeclared templates {sorted(undeclared)} "
                           f"for {key.name}: add them to its templates(key)")
    return text
