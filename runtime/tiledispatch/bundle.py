"""Bundles: a directory with manifest.json and kernels/<name>.so.

The manifest lists every kernel's key, file and sha256, plus the toolchain that built them. Loading a
bundle checks the manifest's structure, then reads each kernel file once (confined to the bundle, no
symbolic links) and checks those bytes against it: sha256, then the key embedded in the file's ELF
section .td_key. A malformed manifest, a missing or changed file or a key that disagrees is a
BundleError, never a silently skipped kernel. The README's "Trust model" says what this does and does
not promise.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import re
import stat
import struct
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from .errors import BundleError
from .spec.key import KernelKey, parse_kernel_name

MANIFEST = "manifest.json"
MANIFEST_SCHEMA_VERSION = 1
KERNEL_DIR = "kernels"
MAX_MANIFEST_BYTES = 64 << 20  # about 40,000 kernels; larger is refused before it is read
MAX_KERNEL_BYTES = 1 << 30  # a kernel file is read into memory whole


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def kernel_file(key: KernelKey) -> str:
    return f"{KERNEL_DIR}/{key.name}.so"


def write_manifest(bundle_dir: str | Path, keys: list[KernelKey], *, backend: str, arch: str,
                   toolchain: dict, kernel_sets: list[str], origins: dict[str, str],
                   build_ids: Optional[dict[str, str]] = None) -> Path:
    """Write manifest.json atomically; every kernel file must already be in place. build_ids: per kernel name, the
    identity of the build that made it (the hash of its inputs, the build's CacheDir key), recorded as build_id."""
    bundle_dir = Path(bundle_dir)
    kernels = []
    for key in sorted(keys, key=lambda k: k.name):
        rel = kernel_file(key)
        kernels.append({"name": key.name, "file": rel, "sha256": sha256_file(bundle_dir / rel),
                        "key": key.to_dict(), "origin": origins.get(key.name, "")})
        if build_ids and key.name in build_ids:
            kernels[-1]["build_id"] = build_ids[key.name]
    manifest = {
        "schema": MANIFEST_SCHEMA_VERSION,
        "backend": backend,
        "arch": arch,
        "kernel_sets": kernel_sets,
        "toolchain": toolchain,
        "host": {"machine": platform.machine(), "system": platform.system()},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "kernels": kernels,
        "selection_models": selection_models(keys),
    }
    target = bundle_dir / MANIFEST
    fd, tmp = tempfile.mkstemp(dir=bundle_dir, prefix=".manifest.")
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, target)
    return target


def selection_models(keys: list[KernelKey], models: Optional[Path] = None) -> dict:
    """Per task of the keys (gemm, conv_<direction>): the learned model that ranks them (its file and version)
    and the kernels it covers but was never trained on; None for a task no model covers. models: a folder whose
    model files replace the shipped ones (learned.model_path)."""
    from . import learned

    out = {}
    for task in sorted({learned.task_of(key) for key in keys}):
        mine = [key for key in keys if learned.task_of(key) == task]
        model = learned.model_for(mine[0].backend, mine[0].arch, task, models)
        out[task] = None if model is None else {
            "model": learned.model_file(mine[0].backend, mine[0].arch, task, models), "version": model.version,
            "covers": sum(model.applies(None, key) for key in mine), "unseen": model.unseen(mine)}
    return out


def remove_stale_kernels(bundle_dir: str | Path, keys: list[KernelKey]) -> list[str]:
    """Delete the kernel files the bundle's previous manifest listed that this bundle no longer lists. Nothing
    else is ever deleted: a file the old manifest does not name (or names outside kernels/) is not the build's,
    and without a readable old manifest nothing is deleted."""
    wanted = {Path(kernel_file(k)).name for k in keys}
    kdir = Path(bundle_dir) / KERNEL_DIR
    old = Path(bundle_dir) / MANIFEST
    try:
        listed = [entry["file"] for entry in json.loads(old.read_text())["kernels"]] if old.is_file() else []
    except (OSError, ValueError, KeyError, TypeError):
        return []
    removed = []
    for rel in listed:
        parts = rel.split("/") if isinstance(rel, str) else []
        if (len(parts) != 2 or parts[0] != KERNEL_DIR or parts[1] in wanted
                or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*\.so", parts[1])):
            continue
        try:
            (kdir / parts[1]).unlink()
            removed.append(parts[1])
        except FileNotFoundError:
            pass
    return removed


def read_manifest(bundle_dir: str | Path) -> dict:
    """The manifest with its structure checked: every entry's name is a kernel name, its key is the key
    that name parses to and is for the bundle's backend and arch, its file is the one the name derives,
    its sha256 is 64 hex digits, and no name appears twice. Entries gain "_key" (the KernelKey) and
    "_path". The kernel files are checked when they are read (read_kernel)."""
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST
    if not bundle_dir.is_dir() or not os.path.lexists(path):
        raise BundleError(f"{bundle_dir} is not a bundle: {MANIFEST} is missing")
    try:
        manifest = json.loads(_read_regular(bundle_dir, MANIFEST, MAX_MANIFEST_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise BundleError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{path}: expected a JSON object, got {_type(manifest)}")
    schema = manifest.get("schema")
    if type(schema) is not int or schema != MANIFEST_SCHEMA_VERSION:
        raise BundleError(f"{path}: manifest schema {schema!r}, expected {MANIFEST_SCHEMA_VERSION}")
    for field, kind in (("backend", str), ("arch", str), ("kernels", list)):
        if field not in manifest:
            raise BundleError(f"{path}: missing field {field!r}")
        if not isinstance(manifest[field], kind):
            raise BundleError(f"{path}: field {field!r} must be a {_type(kind())}, not {_type(manifest[field])}")
    seen = set()
    for i, entry in enumerate(manifest["kernels"]):
        where = f"{path}: kernels[{i}]"
        if not isinstance(entry, dict):
            raise BundleError(f"{where}: expected an object, got {_type(entry)}")
        for field in ("name", "file", "sha256", "key"):
            if field not in entry:
                raise BundleError(f"{where}: missing field {field!r}")
        for field in ("name", "file", "sha256", "origin"):
            if not isinstance(entry.get(field, ""), str):
                raise BundleError(f"{where}: field {field!r} must be a string, not {_type(entry[field])}")
        name = entry["name"]
        try:
            key = parse_kernel_name(name)
        except ValueError as e:
            raise BundleError(f"{where}: {e}") from None
        if name in seen:
            raise BundleError(f"{where}: kernel {name} is listed twice")
        seen.add(name)
        # Compared as canonical JSON: the manifest's key is never interpreted, only matched.
        if _canonical(entry["key"]) != key.to_json():
            raise BundleError(f"{where}: the key of kernel {name} is not the key its name gives")
        if (key.backend, key.arch) != (manifest["backend"], manifest["arch"]):
            raise BundleError(f"{where}: kernel {name} is for {key.backend}/{key.arch}, "
                              f"the bundle for {manifest['backend']}/{manifest['arch']}")
        if entry["file"] != kernel_file(key):
            raise BundleError(f"{where}: file {entry['file']!r}: the file must be {kernel_file(key)}, the path "
                              f"its name derives")
        if not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]):
            raise BundleError(f"{where}: sha256 {entry['sha256'][:80]!r} is not 64 lower-case hex digits")
        entry["_key"] = key
        entry["_path"] = bundle_dir / entry["file"]
    return manifest


def read_kernel(bundle_dir: str | Path, entry: dict) -> bytes:
    """The bytes of a manifest entry's kernel file (read_manifest checked the entry), read once and
    checked: a regular file reached without following any symbolic link inside the bundle, its sha256
    the manifest's, its embedded key (ELF section .td_key) the manifest's. The caller loads these very
    bytes (abi.KernelLibrary.from_image), never the file again, so the file cannot change in between."""
    data = _read_regular(Path(bundle_dir), entry["file"], MAX_KERNEL_BYTES)
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        raise BundleError(f"{bundle_dir}: {entry['file']} has sha256 {digest[:16]}..., the manifest "
                          f"says {entry['sha256'][:16]}...: the file was changed after the build")
    embedded = embedded_key(data, f"{bundle_dir}/{entry['file']}")
    if embedded != entry["_key"].to_json():
        raise BundleError(f"{bundle_dir}/{entry['file']}: the library reports key {describe_key(embedded)} "
                          f"(its embedded key, section {KEY_SECTION.decode()}), the manifest says {entry['name']}")
    return data


def _read_regular(bundle_dir: Path, rel: str, limit: int) -> bytes:
    """The bytes of bundle_dir/rel, each component opened relative to its parent directory's descriptor
    with O_NOFOLLOW: a symbolic link anywhere below the bundle directory, or a file that is not a regular
    file (a FIFO would block the open; O_NONBLOCK keeps it from doing so), is refused."""
    parts = rel.split("/")
    fd = -1
    try:
        try:
            fd = os.open(bundle_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
                parent, fd = fd, -1
                try:
                    fd = os.open(part, flags, dir_fd=parent)
                finally:
                    os.close(parent)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                raise BundleError(f"{bundle_dir}: {rel}: a symbolic link or not a directory on the way: "
                                  f"nothing in a bundle is followed through a link") from None
            if e.errno == errno.ENOENT:
                raise BundleError(f"{bundle_dir}: {rel} is missing") from None
            raise BundleError(f"{bundle_dir}: {rel}: cannot be opened: {e.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BundleError(f"{bundle_dir}: {rel} is not a regular file")
        if st.st_size > limit:
            raise BundleError(f"{bundle_dir}: {rel} is {st.st_size} bytes, larger than the limit of {limit}")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read(st.st_size + 1)
        if len(data) != st.st_size:
            raise BundleError(f"{bundle_dir}: {rel} changed size while it was read")
        return data
    except OSError as e:
        raise BundleError(f"{bundle_dir}: {rel}: cannot be read: {e.strerror or e}") from None
    finally:
        if fd >= 0:
            os.close(fd)


# ELF64: the file header, one program header, one section header (e_ident is checked byte by byte first)
_EHDR = {"<": struct.Struct("<16xHHIQQQIHHHHHH"), ">": struct.Struct(">16xHHIQQQIHHHHHH")}
_PHDR = {e: struct.Struct(e + "IIQQQQQQ") for e in "<>"}
_SHDR = {e: struct.Struct(e + "IIQQQQIIQQ") for e in "<>"}
ET_DYN, PT_LOAD, SHT_NOBITS = 3, 1, 8
KEY_SECTION = b".td_key"


def embedded_key(data: bytes, what: str) -> str:
    """The key JSON a kernel library embeds in its ELF section .td_key (TD_DEFINE_KERNEL_KEY in
    tiledispatch_abi.h), read from the file's bytes before anything loads them. Every offset is checked
    against the buffer, including the loadable segments, so that the image cannot make dlopen map past
    its end. A malformed image is a BundleError."""
    def bad(why: str):
        return BundleError(f"{what}: not a loadable kernel library: {why}")

    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise bad("not an ELF file")
    if data[4] != 2:
        raise bad("not a 64-bit ELF file")
    if data[5] not in (1, 2) or data[6] != 1:
        raise bad("unknown ELF byte order or version")
    e = "<" if data[5] == 1 else ">"
    (e_type, _machine, _version, _entry, phoff, shoff, _flags, _ehsize, phentsize, phnum, shentsize, shnum,
     shstrndx) = _EHDR[e].unpack_from(data)
    if e_type != ET_DYN:
        raise bad("not a shared library")
    if phentsize != _PHDR[e].size or phoff + phnum * phentsize > len(data):
        raise bad("program headers outside the file")
    for p_type, _pflags, p_offset, _vaddr, _paddr, p_filesz, *_ in _PHDR[e].iter_unpack(
            data[phoff:phoff + phnum * phentsize]):
        if p_type == PT_LOAD and p_offset + p_filesz > len(data):
            raise bad("a loadable segment extends past the end of the file (truncated?)")
    if shnum == 0 or shentsize != _SHDR[e].size or shoff + shnum * shentsize > len(data) or shstrndx >= shnum:
        raise bad("section headers missing or outside the file (truncated?)")
    sections = list(_SHDR[e].iter_unpack(data[shoff:shoff + shnum * shentsize]))

    def contents(section) -> bytes:
        _name, sh_type, _f, _a, offset, size, *_ = section
        if sh_type == SHT_NOBITS or offset + size > len(data):
            raise bad("a section outside the file")
        return data[offset:offset + size]

    names = contents(sections[shstrndx])
    found = []
    for section in sections:
        start = section[0]
        end = names.find(b"\0", start)
        if start >= len(names) or end < 0:
            raise bad("a section name outside the section-name table")
        if names[start:end] == KEY_SECTION:
            found.append(section)
    if len(found) != 1:
        raise bad(f"no embedded key (ELF section {KEY_SECTION.decode()})" if not found
                  else f"{len(found)} sections {KEY_SECTION.decode()}")
    text = contents(found[0]).rstrip(b"\0")
    if b"\0" in text:
        raise bad(f"section {KEY_SECTION.decode()} holds more than one string")
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError:
        raise bad(f"section {KEY_SECTION.decode()} is not UTF-8") from None


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def describe_key(key_json: str) -> str:
    """The kernel name of a key JSON for a message; the start of the text if it is not a key."""
    try:
        return KernelKey.from_json(key_json).name
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return repr(key_json[:80])


def _type(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)
