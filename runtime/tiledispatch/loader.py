"""td.load: a bundle directory, a pack file (NAME.tdpack) or the name of an installed pack -> a Registry.

A directory loads as it always has (registry.load: every kernel checked and opened up front) unless
lazy=True. A pack is checked and extracted into the cache (pack.open_pack), and its kernels are opened
lazily: a kernel's library is read, checked against the manifest (sha256, embedded key) and dlopen'ed
when it is first needed, i.e. when a selection asks its td_can_run (only kernels whose signature matches
the problem) or it is named. Listing kernels opens none.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import threading
from pathlib import Path
from typing import Optional, Union

from . import abi, bundle, learned, pack as pack_mod, registry, tuning
from .backends import get as get_backend
from .errors import BundleError
from .spec.key import KernelKey

ENTRY_POINT_GROUP = "tiledispatch.packs"
log = logging.getLogger("tiledispatch")
_OPEN_LOCK = threading.Lock()


class LazyKernel(registry.Kernel):
    """A Kernel whose library is opened on first use, with every check load() makes: the file read once,
    its sha256 and embedded key compared with the manifest, dlopen of a sealed copy of those bytes, then
    (Kernel.__init__) its ABI version and td_kernel_key()."""

    def __init__(self, key: KernelKey, bundle_dir: Path, sha256: str, origin: str = "", name: Optional[str] = None):
        # name: the key's name when the caller already has it checked (deriving it costs ~10 us a kernel)
        self.key, self.name, self.origin = key, name or key.name, origin
        self._bundle_dir, self._sha256 = bundle_dir, sha256
        self._library: Optional[abi.KernelLibrary] = None
        self._path: Optional[Path] = None

    @property
    def path(self) -> Path:
        if self._path is None:
            self._path = self._bundle_dir / bundle.KERNEL_DIR / f"{self.name}.so"
        return self._path

    @path.setter
    def path(self, value) -> None:  # Kernel.__init__ assigns it
        self._path = Path(value)

    @property
    def opened(self) -> bool:
        return self._library is not None

    @property
    def library(self) -> abi.KernelLibrary:
        if self._library is None:
            with _OPEN_LOCK:
                if self._library is None:
                    self._open()
        return self._library

    @library.setter
    def library(self, value) -> None:  # Kernel.__init__ assigns it
        self._library = value

    def _open(self) -> None:
        entry = {"name": self.name, "file": f"{bundle.KERNEL_DIR}/{self.name}.so", "sha256": self._sha256,
                 "_key": self.key}
        data = bundle.read_kernel(self._bundle_dir, entry)
        try:
            library = abi.KernelLibrary.from_image(data, self._sha256, self.path)
        except OSError as err:
            raise BundleError(f"{self.path}: cannot be loaded: {err}") from None
        try:
            registry.Kernel.__init__(self, self.key, self.path, self.origin, library)
        except BaseException:
            self._library = None  # refused: stays unopened, so the next use is refused again
            raise


def load(source: Union[str, Path], *, backend: Optional[str] = None, arch: Optional[str] = None, trust=None,
         lazy: Optional[bool] = None, autotune: bool = False,
         tuning_cache: Optional[tuning.TuningCache] = None, jit: Union[bool, dict] = False,
         models: Union[str, Path, None] = None) -> registry.Registry:
    """Load kernels from `source`: a bundle directory, a pack file, or the name of a pack installed as a
    wheel (entry point group tiledispatch.packs).

    backend / arch: take only the pack's bundles for these. Of the bundles that run on this machine the
    runtime takes those of one backend and arch: the backend of highest auto_priority (a GPU backend
    before cpu), and this device's own arch before another one it can run; the registry's `summary`
    says what it took and skipped and why, `skipped` lists the rest.
    trust: an ed25519 public key (PEM file, PEM text, raw 32 bytes) the pack must be signed with.
    lazy: open each kernel library on first use (the default for packs; lazy=False opens all of them now);
    directories open every kernel up front, as before, unless lazy=True. autotune, tuning_cache: see Registry.
    jit: build on demand the kernels a problem or a kernel name needs that the bundle lacks (registry.load).
    models: a folder of learned ranking models that rank the kernels instead of the shipped ones, for the tasks it
    has a file for (Registry.use_models)."""
    path = Path(source)
    if path.is_dir():
        if trust is not None:
            raise BundleError(f"{path}: trust= checks a pack's signature; a bundle directory carries none "
                              f"(pack it with `python -m tiledispatch pack --sign`)")
        if backend or arch:
            raise BundleError(f"{path}: backend= and arch= choose among a pack's bundles; a directory is one bundle")
        if lazy:
            manifest = bundle.read_manifest(path)
            kernels = [LazyKernel(e["_key"], path, e["sha256"], e.get("origin", "")) for e in manifest["kernels"]]
            if not kernels:
                raise BundleError(f"{path}: the bundle has no kernels")
            reg = registry.Registry(kernels, manifest["backend"], manifest["arch"], manifest, autotune=autotune,
                                    tuning_cache=tuning_cache)
        else:
            reg = registry.load(path, autotune=autotune, tuning_cache=tuning_cache)  # (jit is set below)
        reg.source, reg.skipped = path, []
        reg.summary = f"{path}: using {reg.backend}/{reg.arch} ({len(reg)} kernels)"
        reg.jit = registry.on_demand(jit)
        reg.use_models(models)
        return reg
    if not path.exists():
        text = os.fspath(source)
        if isinstance(source, str) and text and "/" not in text and not text.endswith(pack_mod.SUFFIX):
            path = installed_pack(text)
        else:
            raise BundleError(f"{source}: no such bundle directory or pack file")
    opened = pack_mod.open_pack(path, trust=trust)
    reg = _registry_of_pack(opened, backend, arch, autotune, tuning_cache)
    if lazy is False:  # every kernel opened (and so checked) now
        for kern in reg.kernels:
            kern.library
    reg.jit = registry.on_demand(jit)
    reg.use_models(models)
    return reg


def installed_pack(name: str) -> Path:
    """The pack file of a pack installed under `name` (entry point group tiledispatch.packs, written by
    `python -m tiledispatch wheel`). The entry point names the package that holds NAME.tdpack; the
    package is located, not imported."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        known = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
        raise BundleError(f"{name!r}: no such bundle directory or pack file, and no installed pack of that name "
                          f"(installed packs: {', '.join(known) or 'none'})")
    if len({ep.value for ep in found}) > 1:
        raise BundleError(f"{name!r}: several installed packs have this name ({', '.join(ep.value for ep in found)})")
    module = found[0].value.split(":")[0].strip()
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / f"{name}{pack_mod.SUFFIX}"
        if candidate.is_file():
            return candidate
    raise BundleError(f"installed pack {name!r} (package {module}) has no {name}{pack_mod.SUFFIX}: reinstall it")


class ShippedTuning:
    """A tuning cache (the user's) that falls back on the records a pack carries: a problem this device has
    no record of takes the pack's record for the same device identity, problem and candidate kernels.
    New records go to the user's cache only; the pack's are never written."""

    def __init__(self, own: tuning.TuningCache, shipped_files: list):
        self.own = own
        self.shipped: dict = {}
        for path in shipped_files:  # each checked as the user's file is: bad parts are reported and dropped
            for device, records in tuning.TuningCache(path).records().items():
                for key, rec in records.items():
                    self.shipped.setdefault(device, {}).setdefault(key, rec)

    def records(self) -> dict:
        merged = {device: dict(records) for device, records in self.shipped.items()}
        for device, records in self.own.records().items():
            merged.setdefault(device, {}).update(records)
        return merged

    def get(self, device: str, key: str) -> Optional[dict]:
        return self.own.get(device, key) or self.shipped.get(device, {}).get(key)

    def put(self, device: str, key: str, record: dict) -> None:
        self.own.put(device, key, record)

    def __getattr__(self, name):  # anything else a TuningCache offers: the user's cache
        return getattr(self.own, name)


def _choose(opened: pack_mod.Pack, backend: Optional[str], arch: Optional[str]) -> tuple[list, list]:
    """(the bundles to load: all of one backend and arch, [(bundle, reason skipped)])."""
    skipped, usable = [], []
    for b in opened.manifest["bundles"]:
        if backend and b["backend"] != backend:
            skipped.append((b, f"backend={backend} was asked"))
            continue
        if arch and b["arch"] != arch:
            skipped.append((b, f"arch={arch} was asked"))
            continue
        try:
            ok, why = get_backend(b["backend"]).runnable(b["arch"])
        except ValueError as e:  # a backend this runtime does not know
            ok, why = False, str(e)
        (usable.append(b) if ok else skipped.append((b, why)))
    if not usable:
        raise BundleError(f"{opened.source}: no bundle of this pack runs here: "
                          + "; ".join(f"{b['name']} ({b['backend']}/{b['arch']}): {why}" for b, why in skipped))
    backend_order = sorted({b["backend"] for b in usable},
                           key=lambda n: -get_backend(n).auto_priority)
    best = backend_order[0]
    archs = list(dict.fromkeys(b["arch"] for b in usable if b["backend"] == best))
    if len(archs) > 1:
        native = get_backend(best).detect_arch()
        archs.sort(key=lambda a: a != native)
    chosen = [b for b in usable if (b["backend"], b["arch"]) == (best, archs[0])]
    for b in usable:
        if b not in chosen:
            skipped.append((b, f"{best}/{archs[0]} is preferred here" if b["backend"] == best
                            else f"the {best} bundle is preferred here"))
    return chosen, skipped


def _registry_of_pack(opened: pack_mod.Pack, backend, arch, autotune, tuning_cache) -> registry.Registry:
    chosen, skipped = _choose(opened, backend, arch)
    kernels, seen = [], {}  # name -> (bundle, sha256)
    for b in chosen:
        bdir = opened.bundle_dir(b)
        for k in b["kernels"]:
            if k["name"] in seen:  # the same kernel in two bundles: one is enough when it is the same build
                other, digest = seen[k["name"]]
                if digest != k["sha256"]:
                    raise BundleError(f"{opened.source}: kernel {k['name']} is in bundles {other} and {b['name']} "
                                      f"as two different files (two builds); load one of them: "
                                      f"td.load(..., backend=, arch=) or pack them apart")
                continue
            seen[k["name"]] = (b["name"], k["sha256"])
            try:
                # the extraction checked each key against the kernel's name (bundle.read_manifest); this
                # manifest is that one (the cache entry is named by its sha256)
                key = KernelKey.from_dict(k["key"])
            except (ValueError, TypeError, KeyError) as e:
                raise BundleError(f"{opened.source}: kernel {k['name']}: bad key: {e}") from None
            kernels.append(LazyKernel(key, bdir, k["sha256"], k.get("origin", ""), k["name"]))
    first = chosen[0]
    manifest = {"backend": first["backend"], "arch": first["arch"], "kernel_sets": [s for b in chosen
                for s in b.get("kernel_sets", [])], "toolchain": first.get("toolchain"),
                "created": opened.manifest.get("created"), "kernels": [{"name": k.name} for k in kernels],
                "pack": {"source": str(opened.source), "sha256": opened.digest, "cache": str(opened.root),
                         "bundles": [b["name"] for b in chosen], "signed_by": opened.signed_by}}
    models = [opened.root / m["file"] for m in opened.manifest.get("models", [])
              if (m.get("backend"), m.get("arch")) == (first["backend"], first["arch"])]
    if models:
        learned.add_pack_models(models)
    own = tuning_cache or tuning.TuningCache(tuning.default_path())
    shipped = [opened.root / t["file"] for t in opened.manifest.get("tuning", [])]
    reg = registry.Registry(kernels, first["backend"], first["arch"], manifest, autotune=autotune,
                            tuning_cache=ShippedTuning(own, shipped) if shipped else own)
    reg.source = opened.source
    reg.skipped = [{"bundle": b["name"], "backend": b["backend"], "arch": b["arch"], "reason": why}
                   for b, why in skipped]
    took = ", ".join(b["name"] for b in chosen)
    reg.summary = (f"{opened.source.name}: using {first['backend']}/{first['arch']} ({took}: {len(kernels)} kernels)"
                   + ("; skipped " + "; ".join(f"{s['bundle']} ({s['backend']}/{s['arch']}): {s['reason']}"
                                               for s in reg.skipped) if skipped else ""))
    log.info("%s", reg.summary)
    return reg
