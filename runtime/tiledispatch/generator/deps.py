"""A kernel's build identity, derived: every file that takes part in rendering or compiling it, found from what
the code does rather than from a list someone must keep.

render_inputs(key): the templates its family declares for it (codegen.render refuses to read any other one), the
rules files of its backend and family, and the Python modules the rendering runs: the static import closure of
the generator's codegen module, of the key's family module and of its backend's module (everything they import
inside tiledispatch and templates/, transitively). Another family's or backend's files are not in it.

compile_inputs(key): the headers of our own the source includes (`#include "..."` in its templates and, in turn,
in those headers, resolved in the ABI include directory and the template folders; third-party headers enter
through the toolchain's identity instead) and the static import closure of its backend's toolchain module. The
templates are read, not rendered (rendering every kernel to list its headers would cost ~10 ms a kernel on every
build): a header named under a Jinja condition counts for every kernel of its template, a superset (an edit can
recompile a few kernels more than the ones that include it, never fewer).
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

from .. import backends
from ..spec.key import KernelKey
from . import codegen, rules

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
_ROOTS = ("tiledispatch",)  # what the import closure follows: the package (its families are templates/)


def _source(name: str):
    spec = importlib.util.find_spec(name)
    return None if spec is None or not spec.origin or not spec.origin.endswith(".py") else spec


@functools.lru_cache(maxsize=None)
def module_closure(name: str) -> frozenset[Path]:
    """The files of module `name` and of every module it names in an import statement inside the tiledispatch
    package, transitively: a static walk (what the module can run, whether or not this process ran it).
    `from package import name` follows the submodule `name` where there is one, else the package's __init__; the
    package's own __init__ is not followed otherwise (tiledispatch/__init__.py only re-exports the runtime)."""
    seen: dict[str, Path] = {}
    todo = [name]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        spec = _source(mod)
        if spec is None:
            continue
        seen[mod] = Path(spec.origin).resolve()
        package = mod if spec.submodule_search_locations is not None else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(seen[mod].read_text(), str(seen[mod]))):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.split(".")[0] in _ROOTS]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                if base.split(".")[0] not in _ROOTS:
                    continue
                base_spec = importlib.util.find_spec(base)
                if base_spec is None or base_spec.submodule_search_locations is None:
                    todo.append(base)
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    todo.append(sub if alias.name != "*" and importlib.util.find_spec(sub) is not None else base)
    return frozenset(seen.values())


def _family_module(key: KernelKey) -> str:
    return backends.family_of(key).module.__name__


def render_inputs(key: KernelKey, root: Path = codegen.TEMPLATES_ROOT) -> list[Path]:
    """Every file whose change can change the key's rendered source."""
    files = set(codegen.template_files(key, root))
    files |= {p.resolve() for p in rules.rules_files(key.backend)}  # rules.check(key) reads them all
    for module in (codegen.__name__, _family_module(key), f"{backends.FAMILIES_PACKAGE}.{key.backend}"):
        files |= module_closure(module)
    return sorted(files)


def compile_inputs(key: KernelKey, root: Path = codegen.TEMPLATES_ROOT) -> list[Path]:
    """Our own headers the key's source includes, and its backend's toolchain module (with what it imports)."""
    search = codegen.include_dirs(key, root)
    headers: set[Path] = set()
    todo = list(codegen.template_files(key, root))
    while todo:
        text = todo.pop().read_text()
        for name in _INCLUDE.findall(text):
            found = next((d / name for d in search if (d / name).is_file()), None)
            if found is not None and found.resolve() not in headers:
                headers.add(found.resolve())
                todo.append(found)
    return sorted(headers | module_closure(f"{backends.FAMILIES_PACKAGE}.{key.backend}.toolchain"))
