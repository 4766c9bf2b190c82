"""Bundles: a directory with manifest.json and kernels/<name>.so.

The manifest lists every kernel's key, file and sha256, plus the toolchain that built them. Reading a
bundle verifies every file against it; a missing file, a changed file or a key that disagrees with
the file's embedded key is a BundleError, never a silently skipped kernel.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from .errors import BundleError
from .spec.key import KernelKey, parse_kernel_name

MANIFEST = "manifest.json"
MANIFEST_SCHEMA_VERSION = 1
KERNEL_DIR = "kernels"


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def kernel_file(key: KernelKey) -> str:
    return f"{KERNEL_DIR}/{key.name}.so"


def write_manifest(bundle_dir: str | Path, keys: list[KernelKey], *, backend: str, arch: str,
                   toolchain: dict, kernel_sets: list[str], origins: dict[str, str]) -> Path:
    """Write manifest.json atomically; every kernel file must already be in place."""
    bundle_dir = Path(bundle_dir)
    kernels = []
    for key in sorted(keys, key=lambda k: k.name):
        rel = kernel_file(key)
        kernels.append({"name": key.name, "file": rel, "sha256": sha256_file(bundle_dir / rel),
                        "key": key.to_dict(), "origin": origins.get(key.name, "")})
    manifest = {
        "schema": MANIFEST_SCHEMA_VERSION,
        "backend": backend,
        "arch": arch,
        "kernel_sets": kernel_sets,
        "toolchain": toolchain,
        "host": {"machine": platform.machine(), "system": platform.system()},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "kernels": kernels,
    }
    target = bundle_dir / MANIFEST
    fd, tmp = tempfile.mkstemp(dir=bundle_dir, prefix=".manifest.")
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, target)
    return target


def remove_stale_kernels(bundle_dir: str | Path, keys: list[KernelKey]) -> list[str]:
    """Delete kernel files a previous build left that this bundle no longer lists."""
    wanted = {Path(kernel_file(k)).name for k in keys}
    removed = []
    kdir = Path(bundle_dir) / KERNEL_DIR
    for p in kdir.glob("*.so") if kdir.is_dir() else ():
        if p.name not in wanted:
            p.unlink()
            removed.append(p.name)
    return removed


def read_manifest(bundle_dir: str | Path) -> dict:
    """The manifest, with every entry checked: file present, sha256 equal, key and name agree."""
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST
    if not path.is_file():
        raise BundleError(f"{bundle_dir} is not a bundle: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"{path}: not valid JSON: {e}") from None
    if manifest.get("schema") != MANIFEST_SCHEMA_VERSION:
        raise BundleError(f"{path}: manifest schema {manifest.get('schema')!r}, expected {MANIFEST_SCHEMA_VERSION}")
    for field in ("backend", "arch", "kernels"):
        if field not in manifest:
            raise BundleError(f"{path}: missing field {field!r}")
    for entry in manifest["kernels"]:
        name = entry.get("name", "?")
        try:
            key = KernelKey.from_dict(entry["key"])
        except (KeyError, ValueError) as e:
            raise BundleError(f"{path}: kernel {name}: bad key: {e}") from None
        if key.name != name or parse_kernel_name(name) != key:
            raise BundleError(f"{path}: kernel {name}: its key names it {key.name}")
        if (key.backend, key.arch) != (manifest["backend"], manifest["arch"]):
            raise BundleError(f"{path}: kernel {name} is for {key.backend}/{key.arch}, "
                              f"the bundle for {manifest['backend']}/{manifest['arch']}")
        so = bundle_dir / entry["file"]
        if not so.is_file():
            raise BundleError(f"{bundle_dir}: kernel file {entry['file']} is missing")
        digest = sha256_file(so)
        if digest != entry["sha256"]:
            raise BundleError(f"{bundle_dir}: {entry['file']} has sha256 {digest[:16]}..., the manifest "
                              f"says {entry['sha256'][:16]}...: the file was changed after the build")
        entry["_key"] = key
        entry["_path"] = so
    return manifest
