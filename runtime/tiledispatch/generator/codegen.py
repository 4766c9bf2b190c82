"""Render kernel sources from keys: pure functions over strings, no SCons. One key, one source file.

Templates live in the folder of the key's kernel family, templates/<backend>/<family>/, next to the partials
its backend's families share in templates/<backend>/; they are dumb (loops and conditionals only). Every value
they need comes from the family module's context(key) plus the fields common to all backends below. The family
declares which templates a key uses; rendering any undeclared one fails, so the build's dependency list
(template_files) cannot silently miss a template.
"""
from __future__ import annotations

from pathlib import Path

import jinja2

from .. import abi, backends, families
from ..spec.key import KernelKey
from . import rules, toolchains

# the families package: templates/ of a checkout, tiledispatch/families of an installed wheel
TEMPLATES_ROOT = Path(list(families.__path__)[0]).resolve()


class _RecordingLoader(jinja2.FileSystemLoader):
    def __init__(self, searchpath: list[Path]):
        super().__init__([str(p) for p in searchpath])
        self.loaded: set[str] = set()

    def get_source(self, environment, template):
        self.loaded.add(template)
        return super().get_source(environment, template)


def source_name(key: KernelKey) -> str:
    return key.name + toolchains.get(key.backend).SOURCE_SUFFIX


def template_dirs(key: KernelKey, root: Path = TEMPLATES_ROOT) -> list[Path]:
    """Where the key's templates are looked up: its family's folder, then its backend's (shared partials)."""
    return [root / key.backend / backends.family_of(key).name, root / key.backend]


def include_dirs(key: KernelKey, root: Path = TEMPLATES_ROOT) -> list[Path]:
    """Where a compile of the key's source finds our headers: the ABI's include directory (tiledispatch_abi.h,
    tiledispatch_kernel.h), then the plain C++ headers of its family's folder and its backend's folder."""
    return [abi.INCLUDE_DIR, *template_dirs(key, root)]


def declared_templates(key: KernelKey) -> list[str]:
    """What the key's source may be rendered from: its family's templates (main template first), then its
    activation's file, which every backend's epilogue includes by the key's activation name (through
    activations/_activate.j2)."""
    return [*backends.family_of(key).templates(key), "activations/_activate.j2",
            f"activations/{key.signature.epilogue.activation}.h"]


def _search_dirs(key: KernelKey, root: Path) -> list[Path]:
    return [*template_dirs(key, root), abi.INCLUDE_DIR]


def template_files(key: KernelKey, root: Path = TEMPLATES_ROOT) -> list[Path]:
    """The template files the key's source is rendered from (its build dependencies), main template first."""
    dirs = _search_dirs(key, root)
    out = []
    for name in declared_templates(key):
        found = next((d / name for d in dirs if (d / name).is_file()), None)
        if found is None:
            raise RuntimeError(f"{key.name}: template {name} is in none of {', '.join(map(str, dirs))}")
        out.append(found)
    return out


def render(key: KernelKey, root: Path = TEMPLATES_ROOT) -> str:
    violations = rules.check(key)
    if violations:
        raise ValueError(f"{key.name}: illegal configuration: " + "; ".join(map(str, violations)))
    family = backends.family_of(key)
    declared = declared_templates(key)
    loader = _RecordingLoader(_search_dirs(key, root))
    env = jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, autoescape=False)
    sig, alg = key.signature, key.algorithm
    ctx = {
        "name": key.name, "key_json": key.to_json(), "sig": sig, "alg": alg, "epi": sig.epilogue,
        "key": key, "template": f"templates/{key.backend}/{family.name}/{declared[0]}",
    }
    ctx.update(family.context(key))
    text = env.get_template(declared[0]).render(ctx)
    undeclared = loader.loaded - set(declared)
    if undeclared:
        raise RuntimeError(f"kernel family {key.backend}/{family.name} rendered undeclared templates "
                           f"{sorted(undeclared)} for {key.name}: add them to its templates(key)")
    return text
